"""`draftwise train-head`: heads that draft from the target's hidden states, trained here."""
