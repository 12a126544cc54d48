"""The Redis-resident table: a table whose rows live in Redis.

``EmbeddingTable(dim, storage=StorageOption("REDIS", url, redis_options=...))`` opens it.
``rows`` holds the table's row backend (:class:`~.rows.RedisBackend`, opened by
:func:`~.rows.open_redis_rows`), ``engine`` the Redis side (:class:`~.engine.RedisRowEngine`:
buckets, reads, locks), ``options`` its settings (:class:`~.options.RedisTableOptions`),
``commit`` all-or-nothing commits, ``lua`` the server-side scripts and bucket fields,
``identity`` the table's epoch, ``migrate`` imports, rehashing and dumps. The chain runtime
(:mod:`tensorkv.embedding.chain`) opens it; the Redis client code it uses lives in
:mod:`tensorkv.stores`. See docs/redis_table.md.
"""
