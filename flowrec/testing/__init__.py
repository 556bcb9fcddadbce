"""What tests, tools and benchmarks share: small specs (`specs`), cache-test helpers (`caches`) and
the LRU demand-fetch baseline (`lru`), the options of the step-timing benchmarks (`benchargs`). Nothing in
flowrec's own code paths imports this package.
"""
