"""One module per drafter; each registers itself (`draftwise.speculative.registry` imports them all)."""
