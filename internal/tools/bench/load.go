package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/pgidem/pgidem/internal/canon"
)

// worker is one client of a load: its random source.
type worker struct {
	rng *rand.Rand
}

// transfer picks two random accounts.
func (w *worker) transfer() (from, to int) {
	return w.rng.IntN(accounts) + 1, w.rng.IntN(accounts) + 1
}

// key is a fresh random key, shaped like a UUID (36 characters).
func (w *worker) key() string {
	a, b := w.rng.Uint64(), w.rng.Uint64()
	return fmt.Sprintf("%08x-%04x-4%03x-%04x-%012x", a>>32, (a>>16)&0xffff, a&0xfff, 0x8000|(b>>48)&0x3fff, b&0xffffffffffff)
}

// request is a keyed transfer as a client sends it: a fresh key, and the fingerprint and
// field hashes of its body, computed as the middleware does.
type request struct {
	key      string
	from, to int
	fp       canon.Fingerprint
}

func (w *worker) request() request {
	from, to := w.transfer()
	body := fmt.Appendf(nil, `{"from":%d,"to":%d,"amount":1}`, from, to)
	return request{key: w.key(), from: from, to: to, fp: canon.Compute("POST", path, body)}
}

// sample is one transaction: when it started (from the start of the run) and how long it
// took.
type sample struct{ at, lat time.Duration }

// result is what a run measured.
type result struct {
	// n counts the transactions that succeeded before the run's end.
	n       int
	elapsed time.Duration
	// samples are the successful transactions, in no particular order.
	samples  []sample
	errors   int
	firstErr error
	// cpu is the CPU time this process used during the run (the load generator, and the
	// proxy in the latency part).
	cpu time.Duration
	// machine is the CPU time the whole machine used during the run (every process: the
	// server's too when it runs here), from /proc/stat; 0 where there is none.
	machine time.Duration
}

func (r result) rate() float64 { return float64(r.n) / r.elapsed.Seconds() }

// errNote is the progress line's note: the load generator's CPU, and the errors.
func (r result) errNote() string {
	s := fmt.Sprintf("  (load generator %.2f cores)", r.cpu.Seconds()/r.elapsed.Seconds())
	if r.machine > 0 && r.n > 0 {
		// Per committed transaction: the machine's CPU and this process's share of it.
		s += fmt.Sprintf("  (machine %.2f cores; µs/tx: machine %.0f, load generator %.0f)", r.machine.Seconds()/r.elapsed.Seconds(),
			float64(r.machine.Microseconds())/float64(r.n), float64(r.cpu.Microseconds())/float64(r.n))
	}
	if r.errors == 0 {
		return s
	}
	return s + fmt.Sprintf("  (%d errors; first: %s)", r.errors, firstLine(r.firstErr.Error()))
}

// cpuTime is the CPU time this process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// machineCPU is the CPU time every core of this machine has spent outside idle and iowait
// (the first line of /proc/stat), 0 where there is no /proc.
func machineCPU() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		return 0
	}
	var busy int64
	for i, v := range f[1:8] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0
		}
		busy += n
	}
	const hz = 100 // USER_HZ on Linux
	return time.Duration(busy) * time.Second / hz
}

// maxErrors stops a client that keeps failing.
const maxErrors = 100

// runSeed makes this process's random choices (keys above all) its own; streams numbers
// every random source, so that no two draw the same keys.
var (
	runSeed = uint64(time.Now().UnixNano())
	streams atomic.Uint64
)

// newRand returns a random source of its own.
func newRand() *rand.Rand { return rand.New(rand.NewPCG(runSeed, streams.Add(1))) }

// drive runs one transaction after another on each of clients goroutines until stop is
// closed (or ctx ends), and counts those that succeeded and ended before it was closed.
// Each client has a random source of its own.
func drive(ctx context.Context, clients int, stop <-chan struct{}, tx func(ctx context.Context, w *worker) error) result {
	var (
		mu      sync.Mutex
		res     result
		wg      sync.WaitGroup
		stopped atomic.Bool
		stopAt  atomic.Int64 // from start, in nanoseconds
	)
	cpu0 := cpuTime()
	m0 := machineCPU()
	start := time.Now()
	watch := make(chan struct{})
	go func() {
		defer close(watch)
		select {
		case <-stop:
		case <-ctx.Done():
		}
		stopAt.Store(int64(time.Since(start)))
		stopped.Store(true)
	}()
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := &worker{rng: newRand()}
			var samples []sample
			errs := 0
			var first error
			defer func() {
				if p := recover(); p != nil {
					errs++
					first = fmt.Errorf("panic: %v", p)
				}
				mu.Lock()
				res.samples = append(res.samples, samples...)
				res.errors += errs
				if res.firstErr == nil {
					res.firstErr = first
				}
				mu.Unlock()
			}()
			for !stopped.Load() && errs < maxErrors {
				t0 := time.Now()
				err := tx(ctx, w)
				if err != nil {
					if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
						return
					}
					errs++
					if first == nil {
						first = err
					}
					continue
				}
				samples = append(samples, sample{at: t0.Sub(start), lat: time.Since(t0)})
			}
		}()
	}
	wg.Wait()
	<-watch
	res.cpu = cpuTime() - cpu0
	if m0 > 0 {
		res.machine = machineCPU() - m0
	}
	end := time.Duration(stopAt.Load())
	res.elapsed = end
	kept := res.samples[:0]
	for _, s := range res.samples {
		if s.at+s.lat <= end {
			kept = append(kept, s)
		}
	}
	res.samples = kept
	res.n = len(kept)
	return res
}

// after returns a channel that is closed after d.
func after(d time.Duration) <-chan struct{} {
	c := make(chan struct{})
	time.AfterFunc(d, func() { close(c) })
	return c
}
