"""Several models behind one server: ``pagedllm serve --model A --model B``, ``--models-dir``,
``--models-config``; each model loaded on first use into a server process of its own."""
