"""The KV cache's bookkeeping on the host: the page allocator, the radix prefix cache and the manager that ties them
to requests.
"""
