"""The simulated board on its network link (``sim:link=eth``): ``hw.eth_top.EthLoop`` under
Verilator, reached as a host on its Ethernet segment reaches a board, in UDP datagrams.

``NetworkSim`` wraps the ``SimDevice`` of an ``EthLoop`` (whose byte streams carry Ethernet
frames, each as its 2-byte length and its bytes) as a *datagram device*: ``send_datagram``
puts a UDP datagram (the whole UDP payload: the datagram header of docs/protocol.md, "UDP",
and the stream bytes) in an Ethernet/IPv4/UDP frame from the host to the board
(``sim/tb_eth_udp.py``'s frames, as a host's network stack builds them) and into the
simulation; ``receive_datagrams`` runs the clock until frames come back and returns the UDP
payloads of those the board sent the host (its ARP replies and anything else are not
datagrams). The numbering is the gateware's and the host's: this only carries datagrams.
``hbfp.host.transports.DatagramTransport`` makes one a transport (``hbfp.host.open("sim:link=eth")``);
``hbfp sim-server --device sim:link=eth --udp PORT`` bridges real datagrams into it.
"""

from __future__ import annotations

from .device import SimDevice, Stop
from .tb_eth_udp import parse_udp, udp_frame

__all__ = ["NetworkSim", "HOST_MAC", "HOST_IP", "HOST_PORT"]

#: The simulated host's side of the segment (the board answers whoever sends it a datagram).
HOST_MAC, HOST_IP, HOST_PORT = 0x02_00_00_00_00_0A, 0xC0A8_010A, 49152
#: Quiet cycles after which the frames that were coming are taken as complete.
SETTLE_CYCLES = 64
#: Quiet cycles after which ``receive_datagrams`` returns with nothing (a frame the engine waits
#: the rest of, a long product): more than a frame's way through the link's buffers.
QUIET_CYCLES = 4096


class NetworkSim:
    """A datagram device (module docstring) over the ``SimDevice`` of an ``EthLoop`` for a
    board at ``mac``, ``ip``, ``port``."""

    def __init__(self, sim: SimDevice, *, mac: int, ip: int, port: int):
        self.sim, self.mac, self.ip, self.port = sim, mac, ip, port
        self.cycles_per_second = sim.cycles_per_second
        self._pending = bytearray()
        self.info = dict(getattr(sim, "info", {}) or {})

    def send_datagram(self, payload: bytes) -> None:
        frame = udp_frame(self.mac, HOST_MAC, HOST_IP, self.ip, HOST_PORT, self.port, bytes(payload))
        self.sim.write(len(frame).to_bytes(2, "little") + frame)

    def receive_datagrams(self, budget_cycles: int | None = None) -> list[bytes]:
        """Run the clock until frames come back (at most ``budget_cycles``, default the
        device's ``timeout_cycles``) and the link has settled; the UDP payloads sent to the host."""
        budget = self.sim.timeout_cycles if budget_cycles is None else budget_cycles
        if budget > 0:
            # until output begins, or the link has been quiet a while with every byte taken (the
            # device computing, or waiting for the rest of a frame: the caller's to let time pass)
            ran = self.sim.run(budget, stop=Stop.OUTPUT | Stop.IDLE, idle_cycles=QUIET_CYCLES)
            if ran < budget:  # let the rest of what comes follow
                self.sim.run(budget - ran, stop=Stop.IDLE, idle_cycles=SETTLE_CYCLES)
        self._pending += self.sim.read(timeout_cycles=0)
        out = []
        while len(self._pending) >= 2:
            n = int.from_bytes(self._pending[:2], "little")
            if len(self._pending) < 2 + n:
                break
            frame = bytes(self._pending[2:2 + n])
            del self._pending[:2 + n]
            if frame[12:14] == b"\x08\x00" and frame[0:6] == HOST_MAC.to_bytes(6, "big"):
                out.append(parse_udp(frame)["payload"])
        return out

    @property
    def cycles(self) -> int:
        """The simulated clock's cycles so far."""
        return self.sim.cycles

    def advance(self, cycles: int) -> None:
        self.sim.advance(cycles)

    def close(self) -> None:
        self.sim.close()
