"""compile_shard's FX pass suite over the AOT joint graph (installed as ``compile_shard.passes``).

The source lives in the top-level ``passes/`` folder of the repository and is
installed under the ``compile_shard`` package so that no generic top-level name
(``passes``) lands in site-packages.
"""
