"""Prompts for speculative decoding: the draft heads' training requests and the benchmark's.

TRAINING_PROMPTS: a few hundred varied chat requests (explanations, how-tos, essays, lists, code in
several languages, summaries, comparisons, advice, stories, letters), built from topic lists x
instruction templates in a fixed shuffled order, so the first N of them are a varied sample; then a
second, conversational set (DEFAULT_TRAINING_PROMPTS: how many training answers by default, both sets).
CHAT_PROMPTS: 16 hand-written ordinary chat requests whose topics and phrasings the training set does
not use, so a benchmark on them measures the heads on text they were not fitted to.
CODE_EDIT_PROMPT: ~40 lines of Python to return edited in full: the answer repeats its context, the
case where drafting from the request's own tokens shines.

Each prompt is the text of one user message (`tokenizer.encode_chat([{"role": "user", "content": p}])`).
"""

from __future__ import annotations

import random

TOPICS = [
    "photosynthesis", "the water cycle", "compound interest", "how vaccines work", "plate tectonics",
    "the French Revolution", "black holes", "supply and demand", "machine learning", "the immune system",
    "climate change", "the printing press", "inflation", "renewable energy", "the human heart",
    "volcanoes", "the Roman Empire", "DNA and genes", "electricity", "how the internet works",
    "bees and pollination", "the phases of the moon", "recycling", "gravity", "the stock market",
    "antibiotics", "rainforests", "the Industrial Revolution", "meditation", "time zones", "hurricanes",
    "the periodic table", "democracy", "jazz music", "the game of chess", "the Olympic Games",
    "cloud computing", "electric cars", "the Renaissance", "ocean tides", "earthquakes", "nutrition",
    "the solar system", "public libraries", "honeybee colonies", "the Silk Road", "glaciers",
    "artificial intelligence", "the human brain", "coral reefs",
]  # fmt: skip

TOPIC_TEMPLATES = [
    "Explain {} in simple terms.",
    "Write a short essay about {}.",
    "Give me a list of five interesting facts about {}.",
    "Summarize the key ideas behind {} in one paragraph.",
    "What are the most common misconceptions about {}?",
    "Explain {} to a ten-year-old.",
    "What makes {} worth learning about?",
    "Write three quiz questions with answers about {}.",
    "Describe the history of {} briefly.",
    "What would a beginner need to know about {}?",
]

HOWTO_TASKS = [
    "bake bread at home", "start running", "learn a new language", "prepare for a job interview",
    "save money on groceries", "write a good resume", "grow tomatoes", "organize a small apartment",
    "improve my sleep", "change a flat tire", "make a monthly budget", "study for exams",
    "start a podcast", "care for a houseplant", "plan a road trip", "make cold brew coffee",
    "give a presentation", "learn to play the guitar", "keep a journal", "train a puppy",
    "set up a home network", "write a cover letter", "paint a room", "start investing",
]  # fmt: skip

HOWTO_TEMPLATES = [
    "How do I {}?",
    "Give me step-by-step instructions to {}.",
    "What are some tips to {}?",
    "What mistakes should beginners avoid when they {}?",
    "I want to {}. Where should I start?",
]

COMPARISONS = [
    ("Python", "JavaScript"), ("cats", "dogs as pets"), ("renting", "buying a home"), ("tea", "coffee"),
    ("trains", "planes for travel"), ("SQL", "NoSQL databases"), ("solar", "wind power"),
    ("e-books", "paper books"), ("TCP", "UDP"), ("stocks", "bonds"), ("Linux", "Windows"),
    ("running", "swimming"), ("electric", "gasoline cars"), ("working from home", "working in an office"),
]  # fmt: skip

COMPARISON_TEMPLATES = [
    "Compare {} and {}.",
    "What are the main differences between {} and {}?",
    "Should I choose {} or {}? Explain the trade-offs.",
]

LANGUAGES = ["Python", "JavaScript", "Rust", "Go", "Java", "C", "C++", "TypeScript", "Ruby", "Bash"]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a text file",
    "returns the first n Fibonacci numbers", "sorts a list with merge sort",
    "finds the largest value in a list", "parses a line of comma-separated values",
    "implements a simple stack", "removes duplicates from a list", "converts Celsius to Fahrenheit",
    "implements binary search", "checks whether a string is a palindrome",
    "computes the factorial of a number", "merges two sorted lists", "counts the vowels in a string",
]  # fmt: skip

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Show me a {lang} program that {task}, and explain how it works.",
    "How would you write code in {lang} that {task}? Include an example.",
]

LANGUAGE_QUESTIONS = [
    "Explain how error handling works in {}.",
    "What are the best practices for writing clean {} code?",
    "How do I write unit tests in {}?",
    "What are the basic data types in {}?",
]

ADVICE = [
    "I feel stressed about my exams next month. Any advice?",
    "I have trouble focusing when I work from home. What can I do?",
    "I am moving to a new city where I know nobody. How can I make friends?",
    "I get nervous before speaking in public. How can I feel more confident?",
    "I want to eat healthier but I have little time to cook. Any suggestions?",
    "My team at work keeps missing deadlines. How can I help as a team lead?",
    "I keep procrastinating on important tasks. How can I stop?",
    "How can I be a better listener in conversations?",
    "I want to read more books this year. How can I build the habit?",
    "How should I prepare for my first marathon?",
    "I have a job offer from two companies. How should I decide between them?",
    "How can I reduce the time I spend on my phone?",
]

STORY_SUBJECTS = [
    "a robot who learns to paint", "a dragon who is afraid of the dark", "a detective in a small village",
    "two friends lost in a forest", "a girl who finds a mysterious map", "a cat who travels to the moon",
    "an old clockmaker and his last clock", "a sailor caught in a storm", "a city where it never rains",
    "a boy who can talk to birds", "a time traveler who misses the bus", "a baker who opens a shop on Mars",
]  # fmt: skip

STORY_TEMPLATES = [
    "Write a short story about {}.",
    "Tell me a bedtime story about {}.",
    "Write a poem about {}.",
]

LETTERS = [
    "Write a polite email to my landlord asking to fix a leaking tap.",
    "Write a thank-you note to a colleague who helped me with a project.",
    "Write an email to my manager asking for a day off next Friday.",
    "Write a short letter to a friend I have not seen in years.",
    "Write a complaint email to an online shop about a late delivery.",
    "Write a welcome message for new members of a book club.",
    "Write an email inviting my team to a project kickoff meeting.",
    "Write a short product description for a reusable water bottle.",
]

PASSAGES = [
    "Solar panels convert sunlight into electricity using cells made of silicon. When light hits a cell, "
    "it knocks electrons loose, and the flow of these electrons is an electric current. Panels work best "
    "in direct sunlight but still produce some power on cloudy days. Many homes now combine panels with "
    "batteries so they can use the stored energy at night.",
    "The first public libraries appeared in ancient times, but the modern idea of a free library open to "
    "everyone spread in the nineteenth century. Cities built libraries to give workers access to books "
    "and education. Today libraries also lend e-books, offer computers and internet access, and host "
    "classes and community events.",
    "Sleep is divided into cycles of about ninety minutes. Each cycle includes light sleep, deep sleep and "
    "REM sleep, when most dreaming happens. Deep sleep helps the body repair itself, while REM sleep is "
    "important for memory and learning. Adults need between seven and nine hours of sleep each night.",
    "A budget is a plan for how to spend money. It starts by listing income and expenses, then setting "
    "limits for categories like food, rent and transport. Tracking spending each week shows where money "
    "goes and helps people save for goals such as a holiday or an emergency fund.",
    "Honey never spoils if it is stored properly. Its low water content and high acidity make it hard for "
    "bacteria to grow. Archaeologists have found pots of honey in ancient Egyptian tombs that were still "
    "safe to eat after thousands of years.",
    "Git is a version control system that records changes to files over time. Developers commit snapshots "
    "of their work, create branches to try ideas without affecting the main code, and merge branches "
    "when the work is ready. Remote repositories let teams share their history and collaborate.",
]

PASSAGE_TEMPLATES = [
    "Summarize the following text in two sentences:\n\n{}",
    "Read this paragraph and list its main points:\n\n{}",
]


# Conversational requests as people type them: questions about everyday things, how things work, places
# and the past, practical problems and small writing jobs. None shares a subject with CHAT_PROMPTS.
EVERYDAY_QUESTIONS = [
    "Why do onions make people cry when you cut them?", "Why is the ocean salty but rivers are not?",
    "Why do we yawn, and why is it contagious?", "Why does bread go stale so quickly?",
    "Why do airplanes leave white trails in the sky?", "Why does my voice sound strange on recordings?",
    "Why do some people get motion sickness in cars?", "Why is it harder to breathe on a high mountain?",
    "Why do ice cubes crack when I drop them into a drink?", "Why do our fingers wrinkle in the bath?",
    "Why does coffee keep me awake?", "Why do mirrors flip left and right but not up and down?",
    "Why do we get goosebumps?", "Why do golf balls have dimples?", "Why does metal feel colder than wood?",
    "Why do some countries drive on the left side of the road?", "Why do we have leap years?",
    "Why do bubbles always look round?", "Why does spicy food feel hot?",
    "Why do apples turn brown after cutting?", "Why is the Dead Sea called dead?", "Why do we dream?",
    "Why does popcorn pop?", "Why do songs get stuck in my head?", "Why are flamingos pink?",
    "Why does the moon look bigger near the horizon?", "Why is glass transparent?", "Why do knuckles crack?",
    "Why do people have different blood types?", "Why do candles flicker?",
    "Is it true that we only use ten percent of our brains?", "Is it safe to swim right after eating?",
    "Do goldfish really have a three-second memory?", "Does cracking your knuckles cause arthritis?",
    "Can lightning strike the same place twice?", "What happens to my body when I drink too little water?",
    "What is the difference between weather and climate?",
    "What is the difference between a virus and a bacterium?", "What causes hiccups and how do I stop them?",
    "What makes a rainbow appear?", "What is inside the Earth's core?", "What is a calorie, exactly?",
    "What does a blood test actually measure?",
    "What is the difference between baking soda and baking powder?",
    "What causes traffic jams when there is no accident?", "What is jet lag and how can I avoid it?",
    "What happens when you recycle a plastic bottle?",
    "What is the difference between an alligator and a crocodile?",
    "What is a credit score and why does it matter?", "What do the numbers on a tire mean?",
    "How far away is the nearest star?", "How do noise-cancelling headphones block sound?",
    "How much sleep does a teenager need?", "How do birds know where to fly in winter?",
    "How is chocolate made from cocoa beans?", "How do submarines dive and come back up?",
    "How does a credit card payment go through in a shop?", "How do fireworks get their colors?",
    "How is paper made?", "How do glasses correct bad eyesight?",
]  # fmt: skip

HOW_IT_WORKS = [
    "a microwave oven", "a smartphone touchscreen", "GPS navigation", "an elevator", "a pin tumbler lock",
    "a home thermostat", "a solar-powered calculator", "a hot air balloon", "a magnetic compass",
    "a dishwasher", "a camera lens", "an airplane wing", "a rechargeable battery", "Wi-Fi",
    "a barcode scanner", "a flushing toilet", "an electric kettle", "a smoke detector", "a wind turbine",
    "a hearing aid", "a 3D printer", "a vending machine", "an escalator", "a pressure cooker",
    "a traffic light system", "a search engine", "an electric guitar", "a parachute", "a QR code",
    "a washing machine",
]  # fmt: skip

HOW_IT_WORKS_TEMPLATES = [
    "How does {} work?",
    "Can you explain how {} works, step by step?",
    "What happens inside {} when you use it?",
]

PRACTICAL_QUESTIONS = [
    "How can I get a stain of red wine out of a white shirt?", "What's the best way to learn to touch type?",
    "How do I unclog a bathroom sink without calling a plumber?", "How often should I water a cactus?",
    "What is a good morning routine for someone who is always late?",
    "How can I keep my laptop battery healthy?", "What should I do if my phone gets wet?",
    "How do I politely say no to extra work?", "How can I stop my glasses from fogging up?",
    "What's the easiest way to fold a fitted sheet?", "How should I store fresh herbs so they last longer?",
    "How do I negotiate a higher salary?",
    "My houseplant's leaves are turning yellow. What am I doing wrong?", "How can I sleep on a long flight?",
    "What should I look for when buying a used car?", "How do I back up the photos on my phone?",
    "How can I make a small room look bigger?", "What's a good way to split bills with roommates?",
    "How do I write a strong password that I can still remember?", "How can I calm down before a big exam?",
    "What should I do during the first week at a new job?", "How can I drink more water during the day?",
    "How do I get rid of fruit flies in the kitchen?", "How do I clean a cast iron pan?",
    "How do I start a conversation with someone at a networking event?",
    "How can I save energy at home in winter?",
    "What's a polite way to remind a friend that they owe me money?",
    "How do I keep a sourdough starter alive?", "How can I learn to swim as an adult?",
    "How do I choose a good watermelon at the market?",
    "My laptop is really slow. What can I try before buying a new one?", "How do I sharpen a kitchen knife?",
    "What's the best way to practice a speech?", "How do I teach my grandmother to use video calls?",
    "How can I get better at mental math?", "What should I keep in a first aid kit at home?",
    "How do I prepare for a long hike in hot weather?", "How can I read faster without missing the meaning?",
    "How do I stop procrastinating on cleaning my room?", "How do I make my own compost?",
]  # fmt: skip

SMALL_TASKS = [
    "Suggest five names for a small family bakery.", "Write a limerick about a forgetful wizard.",
    "Plan a three-day trip to Lisbon for someone who loves food.",
    "Give me a 20-minute workout I can do at home.", "Write a short toast for my best friend's wedding.",
    "Write a funny out-of-office reply for my email.", "Give me three ideas for a science fair project.",
    "Write a two-sentence horror story.", "Create a weekly meal plan for a vegetarian student on a budget.",
    "Write a tweet announcing a new coffee shop.", "Give me a packing list for a business trip of two days.",
    "Write a riddle and give the answer at the end.", "Suggest a name and a slogan for a bike repair shop.",
    "Write a short speech to thank volunteers at a charity event.",
    "Make a to-do list for moving into a new apartment.",
    "Write a motivational message for someone starting a diet.",
    "Describe a sunny beach in the style of a travel brochure.",
    "Write a polite message declining a wedding invitation.", "Give me ten questions to ask on a first date.",
    "Write a short review of an imaginary Italian restaurant.",
    "Come up with a fun team-building activity for an office of twenty people.",
    "Write instructions for making a paper airplane.", "Write a job posting for a part-time barista.",
    "Give me a list of board games for a family night.",
    "Write a short dialogue between a customer and a waiter.", "Write a sonnet about the sea.",
    "Help me write a message apologizing for missing a meeting.",
    "Suggest some hobbies for someone who works at a desk all day.",
    "Write a short bio for a freelance graphic designer.",
    "Give me a study schedule for learning basic Spanish in a month.",
    "Write a welcome speech for the first day of a summer camp.",
    "Create a simple workout plan for a beginner runner.",
    "Write a letter to my future self, ten years from now.",
    "Rewrite this sentence to sound more formal: hey, can u send me the file asap?",
    "Give me five tips for taking better photos with a phone.",
    "Write a short fable with a moral at the end.", "Plan a budget-friendly date night at home.",
    "Write a message to a coworker congratulating them on a promotion.",
    "List the pros and cons of living in a big city.",
    "Give me some conversation starters for a dinner party.",
]  # fmt: skip

PLACES_AND_PAST = [
    "What was daily life like for a knight in a medieval castle?",
    "How did people tell the time before clocks?",
    "Who invented the telephone, and how did it change the world?",
    "What is the Great Wall of China made of?", "Tell me about the history of the Eiffel Tower.",
    "Why did the Titanic sink?", "What did people eat in ancient Rome?",
    "How did sailors navigate before GPS?", "What is special about the city of Venice?",
    "How did the Vikings travel so far?", "What was the Cold War about?",
    "Tell me about the first person to walk on the moon.", "What is life like in Antarctica for scientists?",
    "Why is Mount Everest so hard to climb?", "How did the Wright brothers build the first airplane?",
    "What is the Amazon River known for?", "How did ancient Greeks hold the first Olympic games?",
    "What was the Gold Rush in California?", "How were castles defended during a siege?",
    "What should I see on a first visit to Japan?", "What is the history of chocolate?",
    "How did writing first develop?", "What was the Berlin Wall and why did it fall?",
    "What makes the Sahara desert so dry?", "How did people keep food cold before electricity?",
    "What was it like to travel on a steam train?", "Who was Marie Curie and what did she discover?",
    "What is the story behind the Statue of Liberty?", "How did the ancient Maya build their cities?",
    "Why is Iceland called the land of fire and ice?",
]  # fmt: skip


def _training_prompts() -> list[str]:
    """Every template of each group over a rotating share of its topics, then one fixed shuffle."""
    prompts: list[str] = []
    for i, topic in enumerate(TOPICS):  # each topic with 4 of the 10 templates
        prompts += [TOPIC_TEMPLATES[(i + 3 * k) % len(TOPIC_TEMPLATES)].format(topic) for k in range(4)]
    for i, task in enumerate(HOWTO_TASKS):  # 3 of 5
        prompts += [HOWTO_TEMPLATES[(i + k) % len(HOWTO_TEMPLATES)].format(task) for k in range(3)]
    for i, (a, b) in enumerate(COMPARISONS):
        prompts += [COMPARISON_TEMPLATES[(i + k) % len(COMPARISON_TEMPLATES)].format(a, b) for k in range(2)]
    for i, lang in enumerate(LANGUAGES):  # each language with 6 of the tasks
        for k in range(6):
            task = CODE_TASKS[(3 * i + 2 * k) % len(CODE_TASKS)]
            prompts.append(CODE_TEMPLATES[(i + k) % len(CODE_TEMPLATES)].format(lang=lang, task=task))
        prompts.append(LANGUAGE_QUESTIONS[i % len(LANGUAGE_QUESTIONS)].format(lang))
        prompts.append(LANGUAGE_QUESTIONS[(i + 1) % len(LANGUAGE_QUESTIONS)].format(lang))
    prompts += ADVICE
    for i, subject in enumerate(STORY_SUBJECTS):
        prompts += [STORY_TEMPLATES[(i + k) % len(STORY_TEMPLATES)].format(subject) for k in range(2)]
    prompts += LETTERS
    prompts += [template.format(p) for p in PASSAGES for template in PASSAGE_TEMPLATES]
    random.Random(0).shuffle(prompts)
    return prompts


def _conversational_prompts() -> list[str]:
    """The conversational requests, each how-it-works subject with 2 of its 3 templates, shuffled."""
    prompts = EVERYDAY_QUESTIONS + PRACTICAL_QUESTIONS + SMALL_TASKS + PLACES_AND_PAST
    for i, subject in enumerate(HOW_IT_WORKS):
        templates = [HOW_IT_WORKS_TEMPLATES[(i + k) % len(HOW_IT_WORKS_TEMPLATES)] for k in range(2)]
        prompts += [template.format(subject) for template in templates]
    random.Random(1).shuffle(prompts)
    return prompts


# The conversational set comes after the first one: a corpus answering the first N prompts stays a
# prefix of a longer one (scripts/train_draft_heads.py --corpus extends it). Training answers both sets
# by default: over all 16 CHAT_PROMPTS those heads do better than heads of the first set alone
# (docs/benchmarks.md).
_FIRST_SET = _training_prompts()
TRAINING_PROMPTS: list[str] = _FIRST_SET + _conversational_prompts()
DEFAULT_TRAINING_PROMPTS = len(TRAINING_PROMPTS)

CHAT_PROMPTS: list[str] = [
    "What's a good way to remember people's names after meeting them once?",
    "Can you tell me why the sky turns red and orange at sunset?",
    "I have chicken, rice and spinach in the fridge. What could I cook for dinner tonight?",
    "How do the gears on a bicycle make pedaling uphill easier?",
    "My sister's birthday is next week. Help me think of a thoughtful gift under 30 dollars.",
    "Why do cats purr?",
    "Write a haiku about autumn leaves falling in a park.",
    "How does a refrigerator keep food cold?",
    "What should I pack for a weekend camping trip in the mountains?",
    "How were the pyramids of Giza built?",
    "Is it better to stretch before or after exercise?",
    "Could you draft a note for my neighbours about a garden party on Saturday? Keep it friendly.",
    "What does a product manager actually do during a typical day?",
    "How can I make my handwriting neater?",
    "How is volleyball played? Just the basic rules, please.",
    "What are some fun things to do with kids on a rainy afternoon?",
]

_CODE = """\
import json
import os


def load_orders(path):
    data = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            data.append(json.loads(line))
    return data


def total_by_customer(data):
    totals = {}
    for order in data:
        customer = order["customer"]
        amount = order["quantity"] * order["price"]
        totals[customer] = totals.get(customer, 0) + amount
    return totals


def top_customers(data, n=3):
    totals = total_by_customer(data)
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    return ranked[:n]


def write_report(data, out_path):
    lines = []
    for customer, amount in top_customers(data):
        lines.append(f"{customer}: {amount:.2f}")
    with open(out_path, "w") as f:
        f.write("\\n".join(lines))
    return len(lines)


if __name__ == "__main__":
    data = load_orders(os.environ.get("ORDERS", "orders.jsonl"))
    print(write_report(data, "report.txt"))
"""

CODE_EDIT_PROMPT: str = (
    "Here is a Python module:\n\n```python\n" + _CODE + "```\n\n"
    "Rename the variable `data` to `orders` everywhere and add type hints to every function. "
    "Return the whole edited code in one code block, without any explanation."
)
