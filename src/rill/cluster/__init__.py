"""Engine replicas on Ray Serve: ``rill serve --replicas N`` (see docs/cluster.md).

The server process keeps every listener, every protocol and the one submission policy (keys,
caps, rate limits, tokenizing); each engine replica is a Ray Serve replica holding one engine
and its KV cache. The modules:

* ``replica``: ``EngineReplica``, the deployment's class (runs in the replica's process);
* ``router``: ``RillRouter``, Ray Serve's request router for it: a control command goes to the
  replica running its request, a new request to the replica that holds its prompt's prefix
  while load allows, else to the least loaded one;
* ``client``: ``RayClient``, the ``EngineClient`` the protocols talk to, on deployment handles;
* ``launch``: starts (or joins) Ray and deploys the replicas.

Nothing here is imported unless ``--replicas`` is given.
"""
