"""The event path from an engine to every router replica, in one room: the bus's shape and its
in-process backend (``base``), the Ray hub (``ray_bus``) and Redis Streams (``redis_bus``)
backends, the engine side that puts KV events and load samples on it (``forwarder``) and the
router side that reads them into its cache map and load view (``liveness``). What travels on
it is ``cachemap.events``' wire records, applied to the map by ``cachemap.ingest``; the router
reaches the path through ``liveness`` and ``base`` only."""
