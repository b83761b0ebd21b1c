"""A Ray cluster of several nodes on this machine, on loopback, driven line by line (a test helper).

Run as ``python ray_driver.py NODES [HTTP_PORT]`` with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in its environment (Ray then binds
its servers to 127.0.0.1).  Starts a head node and ``NODES - 1`` others of one
CPU each, prints ``address ADDRESS``, then answers one line per command read
from stdin:

- ``add``: a node joins (``added``);
- ``remove``: the last node that joined is lost, its processes killed (``removed``);
- ``deploy JSON`` (with HTTP_PORT): Ray Serve on that port, and
  ``lorahook.server.app:app_builder(JSON)`` deployed as application
  ``lorahook``, again with new options if it runs (``deployed`` once it runs);
- ``quit``: Serve, the driver and the cluster stop (``bye``).

An error is printed as ``error ...``.  The cluster goes down when stdin closes.
"""
import json
import os
import sys

NODE = dict(num_cpus=1, node_ip_address="127.0.0.1", include_dashboard=False,
            object_store_memory=150 << 20)


def main():
    import ray
    from ray.cluster_utils import Cluster

    nodes, port = int(sys.argv[1]), (int(sys.argv[2]) if len(sys.argv) > 2 else None)
    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE))
    workers = [cluster.add_node(**NODE) for _ in range(nodes - 1)]
    cluster.wait_for_nodes()
    print("address", cluster.address, flush=True)
    serving = False
    try:
        for line in sys.stdin:
            command, _, rest = line.strip().partition(" ")
            try:
                if command == "add":
                    workers.append(cluster.add_node(**NODE))
                    cluster.wait_for_nodes()
                    print("added", flush=True)
                elif command == "remove":
                    cluster.remove_node(workers.pop(), allow_graceful=False)
                    print("removed", flush=True)
                elif command == "deploy":
                    from ray import serve

                    from lorahook.server.app import app_builder
                    if not serving:
                        ray.init(address=cluster.address, log_to_driver=False)
                        serve.start(http_options={"host": "127.0.0.1", "port": port})
                        serving = True
                    serve.run(app_builder(json.loads(rest)), name="lorahook", route_prefix="/",
                              blocking=False)
                    print("deployed", flush=True)
                elif command == "quit":
                    break
                else:
                    print("error unknown command", command, flush=True)
            except Exception as exc:  # the test reads it
                print("error", type(exc).__name__, str(exc).replace("\n", " ")[:500], flush=True)
    finally:
        if serving:
            from ray import serve
            serve.shutdown()
            ray.shutdown()
        cluster.shutdown()
        print("bye", flush=True)


if __name__ == "__main__":
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        sys.exit("set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray on loopback)")
    main()
