"""The engines behind the gateway, as it knows them: how it talks to each (``backends``, by ``kinds``), what each
holds in its prefix cache (``cache``, followed from its ``kv_events``), what it is doing (``load``), and the
replicas they make (``replicas``). The planner prices plans against these; the dispatcher sends to them."""
