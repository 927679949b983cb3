"""parse_tcp_info: the fields of struct tcp_info at their offsets, None past a shorter kernel's struct."""
import socket
import struct

import pytest

from dynamix_byteps.agent.procfs import TcpInfo, parse_tcp_info, tcp_info


def test_a_connected_socket_reads_as_established_with_its_bytes_counted():
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        peer, _ = server.accept()
        with peer:
            client.sendall(b"x" * 1000)
            assert len(peer.recv(1000, socket.MSG_WAITALL)) == 1000
            mine, theirs = tcp_info(client), tcp_info(peer)
    assert mine.state == theirs.state == 1  # ESTABLISHED
    assert theirs.bytes_received == 1000
    assert mine.bytes_sent == 1000 and mine.data_segs_out >= 1
    assert mine.rtt_us is not None and mine.rtt_us > 0


def test_every_field_comes_from_its_offset_and_a_short_struct_leaves_the_later_ones_none():
    buf = bytearray(232)
    buf[0] = 1
    struct.pack_into("=I", buf, 68, 250)             # rtt_us
    struct.pack_into("=I", buf, 100, 7)              # total_retrans
    struct.pack_into("=Q", buf, 160, 12_500_000)     # delivery_rate
    struct.pack_into("=Q", buf, 208, 3000)           # bytes_retrans
    full = parse_tcp_info(bytes(buf))
    assert (full.state, full.rtt_us, full.total_retrans, full.delivery_rate, full.bytes_retrans) == \
        (1, 250, 7, 12_500_000, 3000)
    old_kernel = parse_tcp_info(bytes(buf[:168]))  # a 4.9 kernel's struct ends after delivery_rate
    assert old_kernel.delivery_rate == 12_500_000
    assert old_kernel.busy_time_us is None and old_kernel.bytes_sent is None and old_kernel.bytes_retrans is None
    assert parse_tcp_info(b"\x01") == TcpInfo(1, *([None] * 12))


def test_an_empty_buffer_is_refused():
    with pytest.raises(ValueError, match="empty"):
        parse_tcp_info(b"")
