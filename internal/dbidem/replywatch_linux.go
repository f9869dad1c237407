package dbidem

import (
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// socketReceived is the number of bytes the kernel has received on c's TCP socket and how long
// ago it last received data, and whether it could tell (a TCP socket counts them; a Unix
// socket does not).
func socketReceived(c net.Conn) (uint64, time.Duration, bool) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return 0, 0, false
	}
	var n uint64
	var since time.Duration
	var got bool
	control(tc, func(fd int) {
		if info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			n, since, got = info.Bytes_received, time.Duration(info.Last_data_recv)*time.Millisecond, true
		}
	})
	return n, since, got
}

// socketUnread is the number of bytes waiting unread in c's receive buffer (0 when it cannot
// tell).
func socketUnread(c net.Conn) int {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return 0
	}
	n := 0
	control(sc, func(fd int) {
		if v, err := unix.IoctlGetInt(fd, unix.SIOCINQ); err == nil {
			n = v
		}
	})
	return n
}

func control(sc syscall.Conn, f func(fd int)) {
	raw, err := sc.SyscallConn()
	if err != nil {
		return
	}
	_ = raw.Control(func(fd uintptr) { f(int(fd)) })
}
