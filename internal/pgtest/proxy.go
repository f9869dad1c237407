package pgtest

import (
	"bytes"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Fault is what a Proxy does with the bytes it carries.
type Fault int32

const (
	// Forward carries both ways, the server's bytes at Proxy.Rate when it is set.
	Forward Fault = iota
	// Swallow reads the client's bytes (the kernel acks them) and drops them: the query never
	// arrives.
	Swallow
	// Hold reads the server's bytes and drops them: the reply never arrives, and nothing is
	// closed.
	Hold
	// Trickle forwards the server's bytes one every Proxy.TrickleEvery: a path that has all but
	// stopped answering. Turned back to Forward, what a trickle holds goes at once.
	Trickle
)

// commitQuery is COMMIT as pgx sends it alone, in the simple protocol.
var commitQuery = []byte("Q\x00\x00\x00\x0bcommit\x00")

// Proxy forwards connections to a PostgreSQL server, with the faults of a network between an
// application and its database: a query or a reply black-holed, a COMMIT swallowed, a slow
// link, a link that dies midway, a reply that trickles. Its settings apply to every connection
// at once and may change while they run. Every connection is closed when the test's function
// ends, before its cleanups run.
type Proxy struct {
	// Addr is the address to connect to (host:port, or a Unix socket's path).
	Addr string
	// Rate, when above 0, paces the server's bytes to Rate bytes a second, chunk by chunk (an
	// idle connection earns no credit).
	Rate atomic.Int64
	// HoldAfter, when above 0, turns the proxy to Hold once more than HoldAfter bytes of the
	// server's would have been forwarded since ResetSent: a link that dies mid-reply.
	HoldAfter atomic.Int64
	// CommitHole, while set, swallows a COMMIT sent alone (pgx's) and every byte of that
	// connection after it: a COMMIT black-holed.
	CommitHole atomic.Bool
	// TrickleEvery is Trickle's interval; set it before the proxy carries bytes. Default 4 s.
	TrickleEvery time.Duration
	// Buffered, set before a connection opens, reads that connection's server bytes as fast as
	// they come into the proxy's memory and forwards them at Rate, whatever the fault: the
	// server's writes end, and it goes idle, long before the client has the reply (a
	// buffering middlebox in front of a slow client link).
	Buffered atomic.Bool

	fault  atomic.Int32
	sent   atomic.Int64
	closed chan struct{}
	mu     sync.Mutex
	conns  []net.Conn
}

// NewProxy starts a Proxy on 127.0.0.1 in front of target (host:port; TCPAddr is the test
// server's).
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	return NewProxyOn(t, "tcp", "127.0.0.1:0", target)
}

// NewProxyOn is NewProxy listening on network and laddr (a Unix socket's path, say).
func NewProxyOn(t testing.TB, network, laddr, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen(network, laddr)
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{Addr: ln.Addr().String(), TrickleEvery: 4 * time.Second, closed: make(chan struct{})}
	// Closed when the test's function ends, before its cleanups run: a pool made after the
	// proxy is closed after it, and would otherwise wait out pgx's 15 s bound on the cancel
	// request of every connection the proxy holds silent.
	var once sync.Once
	stop := func() {
		once.Do(func() {
			close(p.closed)
			ln.Close()
			p.CloseAll()
		})
	}
	t.Cleanup(stop)
	go func() {
		<-t.Context().Done()
		stop()
	}()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			go p.up(c, s)
			if p.Buffered.Load() {
				go p.downBuffered(s, c)
			} else {
				go p.down(s, c)
			}
		}
	}()
	return p
}

// SlowLink starts a Proxy in front of the test server whose server bytes go at rate bytes a
// second, and which holds everything past holdAfter of them (0: never). It returns its address.
func SlowLink(t testing.TB, rate, holdAfter int) string {
	t.Helper()
	p := NewProxy(t, TCPAddr(t))
	p.Rate.Store(int64(rate))
	p.HoldAfter.Store(int64(holdAfter))
	return p.Addr
}

// SetFault sets what the proxy does from now on, on every connection.
func (p *Proxy) SetFault(f Fault) { p.fault.Store(int32(f)) }

// Fault is what the proxy does now.
func (p *Proxy) Fault() Fault { return Fault(p.fault.Load()) }

// Sent is how many of the server's bytes were forwarded since the last ResetSent.
func (p *Proxy) Sent() int64 { return p.sent.Load() }

// ResetSent starts the count of Sent (and HoldAfter's) again.
func (p *Proxy) ResetSent() { p.sent.Store(0) }

// CloseAll closes every connection the proxy carries now (both ends): a connection reset.
func (p *Proxy) CloseAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// up carries the client's bytes to the server.
func (p *Proxy) up(c, s net.Conn) {
	buf := make([]byte, 32<<10)
	holed := false
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if !holed && p.CommitHole.Load() && bytes.Contains(buf[:n], commitQuery) {
				holed = true
			}
			if !holed && p.Fault() != Swallow {
				if _, werr := s.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// down carries the server's bytes to the client.
func (p *Proxy) down(s, c net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := s.Read(buf)
		if n > 0 {
			switch p.Fault() {
			case Hold:
				// dropped
			case Trickle:
				for i := 0; i < n; i++ {
					if p.Fault() != Trickle { // turned back: the rest goes at once
						if _, werr := c.Write(buf[i:n]); werr != nil {
							return
						}
						break
					}
					if _, werr := c.Write(buf[i : i+1]); werr != nil {
						return
					}
					select {
					case <-p.closed:
						return
					case <-time.After(p.TrickleEvery):
					}
				}
			default:
				if h := p.HoldAfter.Load(); h > 0 && p.sent.Load()+int64(n) > h {
					p.SetFault(Hold) // the link dies: nothing more, nothing closed
					continue
				}
				if _, werr := c.Write(buf[:n]); werr != nil {
					return
				}
				p.sent.Add(int64(n))
				if rate := p.Rate.Load(); rate > 0 {
					time.Sleep(time.Duration(n) * time.Second / time.Duration(rate))
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// downBuffered carries the server's bytes to the client through a queue in memory that takes
// them as fast as the server writes, and empties at Rate (Buffered). The client's end is closed
// once the server's has closed and the queue is empty.
func (p *Proxy) downBuffered(s, c net.Conn) {
	var mu sync.Mutex
	more := sync.NewCond(&mu)
	var queue [][]byte
	eof := false
	go func() {
		for {
			buf := make([]byte, 32<<10)
			n, err := s.Read(buf)
			mu.Lock()
			if n > 0 {
				queue = append(queue, buf[:n])
			}
			eof = err != nil
			more.Signal()
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	defer c.Close()
	for {
		mu.Lock()
		for len(queue) == 0 && !eof {
			more.Wait()
		}
		if len(queue) == 0 {
			mu.Unlock()
			return
		}
		b := queue[0]
		queue = queue[1:]
		mu.Unlock()
		if _, err := c.Write(b); err != nil {
			return
		}
		p.sent.Add(int64(len(b)))
		if rate := p.Rate.Load(); rate > 0 {
			select {
			case <-p.closed:
				return
			case <-time.After(time.Duration(len(b)) * time.Second / time.Duration(rate)):
			}
		}
	}
}
