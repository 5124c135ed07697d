"""Structured outputs: a request's constraint (`sampling.structured_params`) compiled against the
model's vocabulary by llguidance, and followed token by token: the mask of allowed tokens at every
position a step verifies, drafts cut where they leave the grammar, the tokens it forces."""
