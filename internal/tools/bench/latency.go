package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
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

// latencyClients is the number of clients of the latency part, the target's; another
// (BENCH_LATENCY_CLIENTS) prints the ratios without their targets.
const latencyClients = 4

// latencyVariants run through the proxy. BENCH_LATENCY_VARIANTS picks others among the sql
// part's variants on the bench database (nosavepoint, handwritten, replay), for a closer look.
var latencyVariants = []sqlVariant{
	{"nokey", "bench", noKeyTx},
	{"functions", "bench", functionsTx},
	{"seed001", "bench", seed001Tx},
}

// latencySetup is the latency part's clients and variants: latencyClients and latencyVariants,
// or those BENCH_LATENCY_CLIENTS and BENCH_LATENCY_VARIANTS name.
func latencySetup() (int, []sqlVariant, error) {
	clients, err := envInt("BENCH_LATENCY_CLIENTS", latencyClients)
	if err != nil {
		return 0, nil, err
	}
	only := os.Getenv("BENCH_LATENCY_VARIANTS")
	if only == "" {
		return clients, latencyVariants, nil
	}
	var variants []sqlVariant
	for _, name := range strings.Split(only, ",") {
		i := slices.IndexFunc(sqlVariants, func(v sqlVariant) bool { return v.name == name && v.db == "bench" })
		if i < 0 {
			return 0, nil, fmt.Errorf("BENCH_LATENCY_VARIANTS: %q is not a variant of the sql part on the bench database", name)
		}
		variants = append(variants, sqlVariants[i])
	}
	return clients, variants, nil
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
	clients, variants, err := latencySetup()
	if err != nil {
		return err
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
	pool, err := openPool(ctx, b.url, "bench", clients, func(c *pgxpool.Config) {
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
		addedLatency, px.delay.Round(time.Microsecond), rtDirect.Round(time.Microsecond), rtProxied.Round(time.Microsecond), clients, b.rounds, b.seconds)

	pools := map[string]*pgxpool.Pool{"bench": pool}
	tps, fails, err := rounds(ctx, b, clients, variants, pools, "+0.5ms ")
	if err != nil {
		return err
	}
	med := printMedians(variants, tps)
	b.info("SQL +0.5 ms/round trip: SELECT 1 round trip, direct / proxied (ms)",
		fmt.Sprintf("%.3f / %.3f", rtDirect.Seconds()*1000, rtProxied.Seconds()*1000))
	op := ">=" // the target holds for latencyClients only, and when both variants ran
	if clients != latencyClients || med["functions"] == 0 || med["seed001"] == 0 {
		op = ""
	}
	at := fmt.Sprintf("SQL +0.5 ms/round trip, %d clients: ", clients)
	b.ratio(at+"functions / seed 001", med["functions"]/med["seed001"], op, 1.50)
	b.ratio(at+"functions / no key", med["functions"]/med["nokey"], "", 0)
	b.ratio(at+"seed 001 / no key", med["seed001"]/med["nokey"], "", 0)
	if med["nosavepoint"] > 0 {
		b.ratio(at+"functions without the driver (no savepoint) / no key", med["nosavepoint"]/med["nokey"], "", 0)
	}
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
