//go:build !linux

package dbidem

import (
	"net"
	"time"
)

// socketReceived cannot tell outside Linux: a bound ends as a plain deadline would.
func socketReceived(net.Conn) (uint64, time.Duration, bool) { return 0, 0, false }

// socketUnread cannot tell outside Linux.
func socketUnread(net.Conn) int { return 0 }
