"""Prompts for speculative decoding: the draft heads' training requests and the benchmark's.

TRAINING_PROMPTS: a few hundred varied chat requests (explanations, how-tos, essays, lists, code in
several languages, summaries, comparisons, advice, stories, letters), built from topic lists x
instruction templates in a fixed shuffled order, so the first N of them are a varied sample.
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


TRAINING_PROMPTS: list[str] = _training_prompts()

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
