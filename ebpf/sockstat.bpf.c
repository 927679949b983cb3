// SPDX-License-Identifier: GPL-2.0
/* Per-socket TCP statistics for the dynamix node agent (CO-RE, BTF-typed tracepoints only).
 *
 * No kprobes/fentry: only tp_btf, which needs neither tracefs nor kernel headers.
 * Build (setup.py does this at install time):
 *   bpftool btf dump file /sys/kernel/btf/vmlinux format c > vmlinux.h
 *   clang -g -O2 -target bpf -D__TARGET_ARCH_x86 -I<dir of vmlinux.h> -c sockstat.bpf.c -o sockstat.bpf.o
 * Loaded by dynamix_byteps/agent/ebpf.py, whose ctypes structures mirror the structs below:
 * change both together.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "GPL";

#define AF_INET 2
#define AF_INET6 10
#define TCP_CLOSE 7
#define MSG_PEEK 2

/* One TCP socket, keyed by its kernel address (struct sock *). */
struct sock_stat {
    __u64 bytes_sent;    /* bytes returned by send calls on this socket, bytes */
    __u64 bytes_recv;    /* bytes returned by receive calls (MSG_PEEK excluded), bytes */
    __u64 bytes_acked;   /* bytes the peer acknowledged (tcp_sock.bytes_acked, tcp_info's tcpi_bytes_acked) */
    __u64 busy_us;       /* tcp_info's tcpi_busy_time - tcpi_rwnd_limited: data queued or in flight, not held back by the peer's window, microseconds */
    __u64 delivery_rate; /* latest delivery-rate sample as tcp_info's tcpi_delivery_rate, bytes/s (0: none) */
    __u32 tgid;          /* process that first sent/received on it (global pid namespace) */
    __u32 srtt_us;       /* smoothed RTT, microseconds (tcp_sock.srtt_us >> 3) */
    __u32 snd_cwnd;      /* congestion window, segments */
    __u32 total_retrans; /* segments retransmitted over the socket's life (tcp_sock.total_retrans) */
    __u32 sndq;          /* write_seq - snd_una: bytes written, not yet acknowledged */
    __u16 family;        /* AF_INET or AF_INET6 */
    __u16 sport;         /* local port, host order */
    __u16 dport;         /* remote port, host order */
    __u16 _pad;
    __u8 saddr[16];      /* local address, network order (IPv4: first 4 bytes) */
    __u8 daddr[16];      /* remote address, network order (IPv4: first 4 bytes) */
    char comm[16];
};

/* Counters of a process's sockets that have closed, so user space totals never go backwards. */
struct closed_stat {
    __u64 bytes_sent;
    __u64 bytes_recv;
    __u64 retrans;       /* segments */
    __u64 sockets;       /* sockets closed */
};

struct sockstat_cfg {
    __u32 target_tgid;    /* 0 = every process; else only this tgid is recorded */
};

/* The only .rodata variable: the loader writes it before load (offset 0). */
const volatile struct sockstat_cfg cfg = {};

/* Filled in by libbpf from the kernel's config; 0 where it cannot be read (busy_us stays 0). */
extern unsigned int CONFIG_HZ __kconfig __weak;

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 16384);
    __type(key, __u64);
    __type(value, struct sock_stat);
} socks SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 16384);
    __type(key, __u32);
    __type(value, struct closed_stat);
} closed SEC(".maps");

static __always_inline void refresh(struct sock_stat *st, struct tcp_sock *tp)
{
    st->srtt_us = tp->srtt_us >> 3;
    st->snd_cwnd = tp->snd_cwnd;
    st->total_retrans = tp->total_retrans;
    st->sndq = tp->write_seq - tp->snd_una;
    /* tcp_compute_delivery_rate (net/ipv4/tcp.c): segments delivered x MSS / interval */
    __u64 delivered = tp->rate_delivered, interval_us = tp->rate_interval_us;
    if (delivered && interval_us)
        st->delivery_rate = delivered * tp->mss_cache * 1000000 / interval_us;
    st->bytes_acked = tp->bytes_acked;
    /* tcp_get_info_chrono_stats (net/ipv4/tcp.c) less the receive-window-limited chronograph
     * (tcpi_busy_time - tcpi_rwnd_limited): the busy and send-buffer-limited chronographs, plus
     * the running one unless it is the receive-window one, in jiffies. chrono_type is a 2-bit
     * field on older kernels, hence the probed bitfield read. */
    __u64 jiffies = (__u64)tp->chrono_stat[TCP_CHRONO_BUSY - 1] + tp->chrono_stat[TCP_CHRONO_SNDBUF_LIMITED - 1];
    __u32 running = BPF_CORE_READ_BITFIELD_PROBED(tp, chrono_type);
    if (running && running != TCP_CHRONO_RWND_LIMITED)
        jiffies += (__u32)((__u32)bpf_jiffies64() - tp->chrono_start);
    if (CONFIG_HZ)
        st->busy_us = jiffies * (1000000 / CONFIG_HZ);
}

static __always_inline struct sock_stat *get_stat(struct sock *sk, __u32 tgid)
{
    __u64 key = (__u64)sk;
    struct sock_stat *st = bpf_map_lookup_elem(&socks, &key);
    if (st)
        return st;
    struct sock_stat z = {};
    z.tgid = tgid;
    z.family = sk->__sk_common.skc_family;
    z.sport = sk->__sk_common.skc_num;
    z.dport = bpf_ntohs(sk->__sk_common.skc_dport);
    if (z.family == AF_INET6) {
        __builtin_memcpy(z.saddr, &sk->__sk_common.skc_v6_rcv_saddr, 16);
        __builtin_memcpy(z.daddr, &sk->__sk_common.skc_v6_daddr, 16);
    } else {
        __builtin_memcpy(z.saddr, &sk->__sk_common.skc_rcv_saddr, 4);
        __builtin_memcpy(z.daddr, &sk->__sk_common.skc_daddr, 4);
    }
    bpf_get_current_comm(z.comm, sizeof(z.comm));
    bpf_map_update_elem(&socks, &key, &z, BPF_NOEXIST);
    return bpf_map_lookup_elem(&socks, &key);
}

static __always_inline struct closed_stat *get_closed(__u32 tgid)
{
    struct closed_stat *c = bpf_map_lookup_elem(&closed, &tgid);
    if (c)
        return c;
    struct closed_stat z = {};
    bpf_map_update_elem(&closed, &tgid, &z, BPF_NOEXIST);
    return bpf_map_lookup_elem(&closed, &tgid);
}

static __always_inline void account(struct sock *sk, int ret, int flags, int is_send)
{
    if (ret <= 0 || (!is_send && (flags & MSG_PEEK)))
        return;
    __u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (cfg.target_tgid && tgid != cfg.target_tgid)
        return;
    struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk); /* NULL unless a TCP socket */
    if (!tp)
        return;
    if (sk->__sk_common.skc_state == TCP_CLOSE) {
        /* Already closed (e.g. the peer's data and FIN arrived before this recv): its entry is
         * gone and will not be deleted again, so count straight into the closed totals. */
        struct closed_stat *c = get_closed(tgid);
        if (c) {
            if (is_send)
                __sync_fetch_and_add(&c->bytes_sent, ret);
            else
                __sync_fetch_and_add(&c->bytes_recv, ret);
        }
        return;
    }
    struct sock_stat *st = get_stat(sk, tgid);
    if (!st)
        return;
    if (is_send)
        __sync_fetch_and_add(&st->bytes_sent, ret);
    else
        __sync_fetch_and_add(&st->bytes_recv, ret);
    refresh(st, tp);
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(on_send, struct sock *sk, int ret, int flags)
{
    account(sk, ret, flags, 1);
    return 0;
}

SEC("tp_btf/sock_recv_length")
int BPF_PROG(on_recv, struct sock *sk, int ret, int flags)
{
    account(sk, ret, flags, 0);
    return 0;
}

/* Softirq/timer context: the current task is unrelated, so only known sockets are updated. */
static __always_inline struct sock_stat *refresh_known(const struct sock *sk, struct tcp_sock **tpp)
{
    __u64 key = (__u64)sk;
    struct sock_stat *st = bpf_map_lookup_elem(&socks, &key);
    if (!st)
        return NULL;
    struct tcp_sock *tp = bpf_skc_to_tcp_sock((void *)sk);
    if (!tp)
        return NULL;
    refresh(st, tp);
    *tpp = tp;
    return st;
}

SEC("tp_btf/tcp_retransmit_skb")
int BPF_PROG(on_retrans, const struct sock *sk, const struct sk_buff *skb, int err)
{
    struct tcp_sock *tp;
    refresh_known(sk, &tp);
    return 0;
}

/* tcp_probe fires in tcp_rcv_established before the segment is processed, with skb->data at
 * its TCP header. Count what its ACK acknowledges now, as tcp_snd_una_update will: otherwise
 * a sender's last ACK would only show at the socket's next event, in a later interval. */
SEC("tp_btf/tcp_probe")
int BPF_PROG(on_probe, struct sock *sk, const struct sk_buff *skb)
{
    struct tcp_sock *tp;
    struct sock_stat *st = refresh_known(sk, &tp);
    if (!st)
        return 0;
    struct tcphdr th;
    if (bpf_probe_read_kernel(&th, sizeof(th), skb->data) || !th.ack)
        return 0;
    __u32 ack = bpf_ntohl(th.ack_seq), una = tp->snd_una, nxt = tp->snd_nxt;
    if ((__s32)(ack - una) > 0 && (__s32)(nxt - ack) >= 0)
        st->bytes_acked += ack - una;
    return 0;
}

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(on_state, const struct sock *sk, const int oldstate, const int newstate)
{
    if (newstate != TCP_CLOSE)
        return 0;
    __u64 key = (__u64)sk;
    struct sock_stat *st = bpf_map_lookup_elem(&socks, &key);
    if (!st)
        return 0;
    struct closed_stat *c = get_closed(st->tgid);
    if (c) {
        struct tcp_sock *tp = bpf_skc_to_tcp_sock((void *)sk);
        if (tp)
            refresh(st, tp); /* final total_retrans */
        __sync_fetch_and_add(&c->bytes_sent, st->bytes_sent);
        __sync_fetch_and_add(&c->bytes_recv, st->bytes_recv);
        __sync_fetch_and_add(&c->retrans, st->total_retrans);
        __sync_fetch_and_add(&c->sockets, 1);
    }
    bpf_map_delete_elem(&socks, &key);
    return 0;
}
