"""Model families and the transformer body they share."""
