package dbidem

import (
	"io"
	"testing"
	"time"
)

// The reply watch's eyes on a socket: over TCP the count of received bytes moves and unread
// bytes show; over a Unix socket unread bytes show. Without them every bound would be the
// plain one, silently (D213). Linux only: elsewhere the bound is the plain one.
func TestReplyWatchSeesBytesArrive(t *testing.T) {
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			client, server := watchPair(t, network)
			// A reply that came and was read before the first look: the kernel's time of the
			// last data, after the statement was sent, tells (TCP).
			early := newReplyWatch(client, time.Now())
			time.Sleep(30 * time.Millisecond) // past the kernel's clock tick and replyTickSlack
			if _, err := server.Write([]byte("early")); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(client, make([]byte, 5)); err != nil {
				t.Fatal(err)
			}
			if got := early.arriving(time.Now()); got != (network == "tcp") {
				t.Fatalf("a reply read before the first look seen arriving: %v", got)
			}
			if early.counted != (network == "tcp") {
				t.Fatalf("counted = %v", early.counted)
			}
			w := newReplyWatch(client, time.Now())
			if w.arriving(time.Now()) {
				t.Fatal("arriving before a byte was sent")
			}
			if _, err := server.Write(make([]byte, 1000)); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(5 * time.Second)
			for socketUnread(client) < 1000 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			if !w.arriving(time.Now()) || !w.began {
				t.Fatalf("1000 unread bytes not seen arriving (unread %d)", socketUnread(client))
			}
			if _, err := client.Read(make([]byte, 1000)); err != nil {
				t.Fatal(err)
			}
			if network == "tcp" {
				if w.arriving(time.Now()) {
					t.Fatal("arriving with nothing new and nothing unread")
				}
				if _, err := server.Write([]byte("x")); err != nil {
					t.Fatal(err)
				}
				for socketUnread(client) < 1 && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
				if _, err := client.Read(make([]byte, 1)); err != nil {
					t.Fatal(err)
				}
				if !w.arriving(time.Now()) {
					t.Fatal("a byte received and read was not seen by the count")
				}
			}
		})
	}
}
