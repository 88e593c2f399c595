"""The request's life on the host: requests, sampling params, outputs, the ragged batch, the scheduler, stop checks,
the tokenizer and the engine config.
"""
