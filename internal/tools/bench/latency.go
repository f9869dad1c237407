package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/Shopify/toxiproxy/v2/toxics"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
)

// latencyUsToxic is toxiproxy's latency toxic (toxics/latency.go) in microseconds: it
// passes every chunk on Latency ± Jitter microseconds after it arrived. The built-in one
// takes whole milliseconds only.
type latencyUsToxic struct {
	Latency int64 `json:"latency_us"`
	Jitter  int64 `json:"jitter_us"`
}

func (t *latencyUsToxic) GetBufferSize() int {
	return 1024
}

func (t *latencyUsToxic) delay() time.Duration {
	delay := t.Latency
	if t.Jitter > 0 {
		delay += rand.Int64N(t.Jitter*2) - t.Jitter
	}
	return time.Duration(delay) * time.Microsecond
}

// Pipe is the built-in latency toxic's, with one difference: it sleeps in nanosleep(2), not
// on a Go timer. A Go timer shorter than a millisecond sleeps a whole millisecond when the
// runtime is idle (its poller waits in milliseconds), which made the toxic add 1.1 ms
// instead of 0.5; a blocking nanosleep keeps to within about 0.1 ms. An interrupt (a toxic
// added, updated or removed) waits for the current sleep to end.
func (t *latencyUsToxic) Pipe(stub *toxics.ToxicStub) {
	for {
		select {
		case <-stub.Interrupt:
			return
		case c := <-stub.Input:
			if c == nil {
				stub.Close()
				return
			}
			if sleep := t.delay() - time.Since(c.Timestamp); sleep > 0 {
				nanosleep(sleep)
				c.Timestamp = c.Timestamp.Add(sleep)
			}
			stub.Output <- c
		}
	}
}

// nanosleep blocks the calling thread for d.
func nanosleep(d time.Duration) {
	ts := syscall.NsecToTimespec(int64(d))
	for syscall.Nanosleep(&ts, &ts) == syscall.EINTR {
	}
}

func init() {
	toxics.Register("latency_us", new(latencyUsToxic))
}

// addedLatency is what the proxy adds to every round trip, on the downstream stream only
// (server to client: each answer is delayed once).
const addedLatency = 500 * time.Microsecond

// latencyClients is the number of clients of the latency part.
const latencyClients = 4

// latencyVariants run through the proxy.
var latencyVariants = []sqlVariant{
	{"nokey", "bench", noKeyTx},
	{"functions", "bench", functionsTx},
	{"seed001", "bench", seed001Tx},
}

// proxy is an in-process toxiproxy in front of the server whose toxic delays every answer
// (the downstream stream only: each round trip is delayed once).
type proxy struct {
	p     *toxiproxy.Proxy
	delay time.Duration // the toxic's delay
}

func startProxy(upstream string) (*proxy, error) {
	server := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	p := toxiproxy.NewProxy(server, "postgres", "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		return nil, err
	}
	if _, err := p.Toxics.AddToxicJson(strings.NewReader(fmt.Sprintf(
		`{"name": "latency", "type": "latency_us", "stream": "downstream", "toxicity": 1, "attributes": {"latency_us": %d}}`,
		addedLatency.Microseconds()))); err != nil {
		p.Stop()
		return nil, err
	}
	return &proxy{p: p, delay: addedLatency}, nil
}

func (p *proxy) setDelay(d time.Duration) error {
	_, err := p.p.Toxics.UpdateToxicJson("latency", strings.NewReader(fmt.Sprintf(
		`{"toxicity": 1, "attributes": {"latency_us": %d}}`, d.Microseconds())))
	if err == nil {
		p.delay = d
	}
	return err
}

// calibrate sets the toxic's delay so that a round trip through the proxy takes
// addedLatency more than a direct one: the proxy's own forwarding and the sleep's overshoot
// count as part of the added latency. It returns the direct and proxied round trips.
func (p *proxy) calibrate(ctx context.Context, direct, proxied *pgxpool.Pool) (rtDirect, rtProxied time.Duration, err error) {
	for range 3 {
		if rtDirect, err = pingMedian(ctx, direct); err != nil {
			return 0, 0, err
		}
		if rtProxied, err = pingMedian(ctx, proxied); err != nil {
			return 0, 0, err
		}
		excess := rtProxied - rtDirect - addedLatency
		if excess.Abs() < 20*time.Microsecond {
			break
		}
		if err := p.setDelay(max(p.delay-excess, 0)); err != nil {
			return 0, 0, err
		}
	}
	return rtDirect, rtProxied, nil
}

// latencyPart runs functions, seed 001 and no key through the proxy with 4 clients.
func latencyPart(ctx context.Context, b *bench) error {
	if b.upstream == "" {
		return errors.New("the latency proxy needs the server on TCP; BENCH_DATABASE_URL names a Unix socket")
	}
	if err := b.database(ctx, "bench"); err != nil {
		return err
	}
	px, err := startProxy(b.upstream)
	if err != nil {
		return err
	}
	defer px.p.Stop()
	addr := px.p.Listen
	host, portText, _ := strings.Cut(addr, ":")
	port, err := strconv.Atoi(portText)
	if err != nil {
		return fmt.Errorf("proxy address %q: %w", addr, err)
	}
	pool, err := openPool(ctx, b.url, "bench", latencyClients, func(c *pgxpool.Config) {
		c.ConnConfig.Host, c.ConnConfig.Port, c.ConnConfig.Fallbacks = host, uint16(port), nil
	})
	if err != nil {
		return fmt.Errorf("connect through the proxy (%s): %w", addr, err)
	}
	defer pool.Close()
	direct, err := openPool(ctx, b.url, "bench", 1, nil)
	if err != nil {
		return err
	}
	defer direct.Close()
	rtDirect, rtProxied, err := px.calibrate(ctx, direct, pool)
	if err != nil {
		return err
	}
	fmt.Printf("SQL through a proxy that adds %s to every round trip (toxic delay %s; SELECT 1: %s direct, %s proxied), %d clients, %d rounds of %ds\n",
		addedLatency, px.delay.Round(time.Microsecond), rtDirect.Round(time.Microsecond), rtProxied.Round(time.Microsecond), latencyClients, b.rounds, b.seconds)

	pools := map[string]*pgxpool.Pool{"bench": pool}
	tps, fails, err := rounds(ctx, b, latencyClients, latencyVariants, pools, "+0.5ms ")
	if err != nil {
		return err
	}
	med := printMedians(latencyVariants, tps)
	b.info("SQL +0.5 ms/round trip: SELECT 1 round trip, direct / proxied (ms)",
		fmt.Sprintf("%.3f / %.3f", rtDirect.Seconds()*1000, rtProxied.Seconds()*1000))
	b.ratio("SQL +0.5 ms/round trip, 4 clients: functions / seed 001", med["functions"]/med["seed001"], ">=", 1.50)
	b.ratio("SQL +0.5 ms/round trip, 4 clients: functions / no key", med["functions"]/med["nokey"], "", 0)
	b.ratio("SQL +0.5 ms/round trip, 4 clients: seed 001 / no key", med["seed001"]/med["nokey"], "", 0)
	return fails.err()
}

// pingMedian is the median time of 200 SELECT 1 on one connection of pool.
func pingMedian(ctx context.Context, pool *pgxpool.Pool) (time.Duration, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Release()
	var times []time.Duration
	for range 200 {
		t0 := time.Now()
		var one int
		if err := conn.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
			return 0, err
		}
		times = append(times, time.Since(t0))
	}
	slices.Sort(times)
	return times[len(times)/2], nil
}
