//go:build !linux

package dbidem

import "net"

// socketReceived cannot tell outside Linux: a bound ends as a plain deadline would.
func socketReceived(net.Conn) (uint64, bool) { return 0, false }

// socketUnread cannot tell outside Linux.
func socketUnread(net.Conn) int { return 0 }
