"""Text and token ids: the tokenizer (and incremental detokenization), the model's chat template, and
where client text sits in a rendered conversation, so that control tokens come only from the template."""
