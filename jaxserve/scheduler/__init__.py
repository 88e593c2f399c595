"""The scheduler and its KV bookkeeping on the host: which tokens run each step (`scheduler`), the page allocator,
the radix prefix cache and the manager that ties pages to requests (`kv_cache_manager`)."""
