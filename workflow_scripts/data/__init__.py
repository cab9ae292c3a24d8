"""data: raw files to per-node shards and token caches. Entry scripts: split (split_dataset), tokenization
(tokenize_shard, tokenize_eval), data_report, make_demo_data. Libraries: readers (file formats), mappings (record
layouts to prompt/response or messages), chat_format and chat_render (the model's own template, rendered and
masked), tool_calls (tool-call conversations: read, checked, given to the template, and calls found in generated
text), token_cache, token_store, packing, identity.

A new file format is one entry in readers.py's table; a new record layout one entry in mappings.py's (each module's
docstring says how), and the value in config/schema.yaml's enum (a test holds them equal).
"""
