"""How many tokens to draft: the measured cost model (and its cache), the goodput controller per
request, and the policies the engine asks (fixed k, or adaptive per request and batch)."""
