"""Object stores on 127.0.0.1 for the tests and benches: moto's S3 server and Azure's emulator
(Azurite), both from the `dev` set-up (`scripts/setup.sh --test`), and a proxy that gives either
a network's round-trip time. Started and stopped by pid like the broker (`LocalService`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TextIO

from entity_assets.local_service import LocalService

AZURITE = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
"""Where `scripts/setup.sh --test` installs Azurite: beside the virtualenv's packages."""


@dataclass(frozen=True)
class LocalStore(LocalService):
    """An object store's emulator, ready once it listens; `account` is its URL path."""

    account: ClassVar[str] = ""

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}{self.account}"

    def ready(self) -> bool:
        return self.listening()


class LocalS3(LocalStore):
    name, program = "s3", "moto.server"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]


class LocalAzurite(LocalStore):
    """Azure Blob Storage's emulator, in memory, on the Blob API only (as a flat-namespace account),
    without its telemetry: it would send usage to Azure Monitor, and keep what it failed to send
    in the temporary folder at every start."""

    name, account, program = "azurite", "/devstoreaccount1", "azurite"

    def command(self) -> list[str]:
        return [str(AZURITE), "--blobHost", self.host, "--blobPort", str(self.port), "--inMemoryPersistence",
                "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"]


@dataclass(frozen=True)
class LatencyProxy(LocalStore):
    """A TCP proxy to `target` that holds each request for `rtt_ms`: about the round trip of a
    real store's network, which loopback does not have (and this machine has no netem to add).

    A request is what a client sends after the last answer on its connection: its first chunk
    waits, the rest of an upload streams on, as on a network whose bandwidth is not the limit.
    """

    target: int = 0
    rtt_ms: float = 0.0
    log: str = ""
    """A file to which each request's time, connection and first line are appended (to see which wait in a row)."""
    name, program = "latency-proxy", "entity_assets.local_stores"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "entity_assets.local_stores", "--port", str(self.port), "--target",
                str(self.target), "--rtt-ms", str(self.rtt_ms), *(["--log", self.log] if self.log else [])]


async def _proxy(port: int, target: int, rtt_ms: float, log: TextIO | None = None) -> None:
    async def connect(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_writer.close()
            return
        answered = [True]  # whether the server spoke since the client's last chunk: a new request

        async def pipe(reader, writer, request: bool):
            try:
                while data := await reader.read(1 << 16):
                    if request and answered[0]:
                        if log:
                            line = data[:200].split(b"\r\n", 1)[0].decode(errors="replace")
                            log.write(f"{time.time():.4f} {id(writer):x} {line}\n")
                        if rtt_ms:
                            await asyncio.sleep(rtt_ms / 1000)
                    answered[0] = not request
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_reader, server_writer, True), pipe(server_reader, client_writer, False))

    server = await asyncio.start_server(connect, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="a TCP proxy on 127.0.0.1 that adds a round trip per request")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--log", help="append each request's time, connection and first line to this file")
    args = parser.parse_args(argv)
    with open(args.log, "a", buffering=1) if args.log else contextlib.nullcontext() as log:
        asyncio.run(_proxy(args.port, args.target, args.rtt_ms, log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
