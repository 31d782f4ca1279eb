"""`python -m agent.simulator --port P --serial S [--model NAME] [--root DIR] [--adb-keys FILE]`:
serve one virtual phone until Ctrl-C or SIGTERM. It asks for ADB authentication unless
--no-auth is given, and lets in the hosts whose keys --adb-keys lists (or, with
--accept-new-keys, any host, as if someone tapped "Allow" each time)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from agent.simulator.models import MODELS
from agent.simulator.phone import auth_note, run_simulator


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agent.simulator", description=__doc__.split("\n")[1])
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: a free one); avoid 5555-5585")
    parser.add_argument("--serial", required=True, help="the serial number the phone reports")
    parser.add_argument("--model", default="Pixel 7", choices=sorted(MODELS), help="phone model to pose as")
    parser.add_argument("--root", type=Path, default=None, help="sandbox folder (default: a temporary one)")
    parser.add_argument("--auth", action=argparse.BooleanOptionalAction, default=True,
                        help="require RSA authentication of hosts (default; --no-auth: anyone who reaches the port)")
    parser.add_argument("--adb-keys", type=Path, default=None,
                        help="host public keys (adbkey.pub) the phone accepts, read at each connection")
    parser.add_argument("--accept-new-keys", action="store_true",
                        help="accept any host's key on first connection, as if 'Allow' were tapped")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run_simulator(args.port, args.serial, model=args.model, root=args.root, auth=args.auth, host=args.host,
                  adb_keys=args.adb_keys, accept_new_keys=args.accept_new_keys,
                  ready=lambda port: print(f"virtual phone {args.serial} listening on {args.host}:{port}"
                                           f"{auth_note(args.auth, args.adb_keys, args.accept_new_keys)}", flush=True))


if __name__ == "__main__":
    main()
