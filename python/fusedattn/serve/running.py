"""An application served from a thread of this process, on 127.0.0.1 at a
free port: the benchmark's own server and the tests'."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

__all__ = ["Running"]


class Running:
    """Serves app until stop(); url is its address (http://127.0.0.1:PORT)."""

    def __init__(self, app: web.Application):
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app, handler_cancellation=True)
        ready, failed = threading.Event(), []

        def serve():
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.runner.setup())
                site = web.TCPSite(self.runner, "127.0.0.1", 0)
                self.loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]
            except Exception as e:  # noqa: BLE001  (raised in the caller's thread below)
                failed.append(e)
                return
            finally:
                ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, name="fusedattn-serve-http", daemon=True)
        self.thread.start()
        if not ready.wait(60) or failed:
            raise RuntimeError(f"fusedattn.serve: the server did not start ({failed[0] if failed else 'timeout'})")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
