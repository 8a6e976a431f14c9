"""Text in and out: the tokenizer (a HF tokenizer.json or a GGUF file's vocabulary, with
its chat template) and the incremental detokenizer that turns a stream of token ids into
text without splitting a UTF-8 character or a stop string."""
