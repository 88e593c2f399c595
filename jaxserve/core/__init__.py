"""The request's life on the host: requests, sampling params, outputs, the ragged batch, stop rules, the tokenizer and
detokenizer, prompt validation.
"""
