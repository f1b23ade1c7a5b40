"""Data-parallel front: ``pagedllm router`` (in front of separately started ``pagedllm serve``
servers) and ``pagedllm serve --data-parallel-size N`` (N child servers plus this router).

Requests go to the replica whose approximate prefix index holds the longest prefix of the
request's block hash chain (the engines' own hash function), falling back to the least loaded.
"""
