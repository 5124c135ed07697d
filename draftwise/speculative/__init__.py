"""The heart of draftwise: drafters behind one protocol and one registry, verification that keeps
the target's output exactly (greedy, rejection sampling, seeded equality), and the controller that
drafts only where it pays, from costs measured on this machine. It never imports the engine: what it
needs of a request is `sequence.SequenceState`."""
