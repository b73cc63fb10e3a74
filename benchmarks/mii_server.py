"""DeepSpeed-MII (FastGen) behind its own REST gateway for as long as this process lives: the peer burstgate's
``mii`` kind talks to (``POST /mii/<deployment>``, ``GET /healthz``). Stopped by SIGTERM or SIGINT, it takes its
server processes down with it. Needs a GPU and DeepSpeed's FastGen ops (benchmarks/gpu_check.py, part mii).

    python benchmarks/mii_server.py MODEL_DIR --port 28080 --name design-12b
"""

from __future__ import annotations

import argparse
import signal
import threading


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="local HF directory (config.json and tokenizer; weights, or random ones "
                                      "where DeepSpeed's checkpoint engine is told to draw them)")
    parser.add_argument("--port", type=int, default=28080)
    parser.add_argument("--name", default="mii", help="the deployment's name: POST /mii/<name>")
    parser.add_argument("--processes", type=int, default=32, help="REST gateway processes (its concurrency)")
    args = parser.parse_args()

    import mii

    client = mii.serve(args.model, deployment_name=args.name, enable_restful_api=True, restful_api_port=args.port,
                       restful_api_host="127.0.0.1", restful_processes=args.processes, tensor_parallel=1,
                       replica_num=1)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"MII serving {args.name} at http://127.0.0.1:{args.port}/mii/{args.name}", flush=True)
    stop.wait()
    client.terminate_server()


if __name__ == "__main__":
    main()
