package history

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Key is one idempotency key of a run: whose, its name, the route its requests take, and
// the TTL and lease they claim it with.
type Key struct {
	Principal, Name string
	Route           Route
	TTL, Lease      time.Duration
	// Data is the harness's own (the accounts a key's requests move money between).
	Data any
}

// String is the key's partition name, principal/name.
func (k Key) String() string { return k.Principal + "/" + k.Name }

// Request is one request under a key: the same Variant is the same request (fingerprint).
type Request struct {
	Key     Key
	Variant int
	// Fingerprint binds the key; Text is the request, readable.
	Fingerprint, Text string
	// Route overrides the key's route for this request when set (a transactional claim
	// under a key whose lease died): RouteSet says it is.
	Route    Route
	RouteSet bool
	// Hold and Release ask a driver that claims leases itself to leave the lease held (no
	// answer) or release it, once claimed.
	Hold, Release bool
	// Work asks the harness to make the work take this long (the claim and the answer that
	// far apart, or a holder stalled past its lease); 0: the harness's own.
	Work time.Duration
	// Stepped asks a harness that can for work in steps (idem.Step): each step writes a row,
	// and the answer names them (Output.Steps).
	Stepped bool
	// Payload is the harness's own.
	Payload any
}

// StepObserver is a Harness that also reports the rows its stepped work wrote under a key.
type StepObserver interface {
	ObserveSteps(ctx context.Context, k Key) ([]StepEffect, error)
}

// Harness is what a run needs from the system under test.
type Harness interface {
	// NewKey makes a key on this route.
	NewKey(rng *rand.Rand, name string, route Route) Key
	// Request is the key's request number variant.
	Request(k Key, variant int) Request
	// Send sends r once, as client c, and says what it learned: Unknown when ctx ended first.
	Send(ctx context.Context, c int, r Request) Output
	// Observe returns the effects found under the key once the run settled.
	Observe(ctx context.Context, k Key) ([]string, error)
}

// Scenario drives one key (or a few) through a session.
type Scenario struct {
	// Name counts it in the run's report.
	Name string
	// Weight is how often it is drawn, relative to the others.
	Weight int
	// Run drives it.
	Run func(s *Session)
}

// Runner runs scenarios on Mode.Workers workers (each with clients of its own) until the run
// is big enough.
type Runner struct {
	H         *History
	Harness   Harness
	Scenarios []Scenario
	// Mode is the size of the run.
	Mode Mode
	// OpTimeout bounds one operation; a client that waited that long gives up (Unknown).
	OpTimeout time.Duration
	// Also, when set, must be true too before the run stops (every fault injected once).
	Also func() bool

	mu      sync.Mutex
	keys    []Key
	ran     map[string]int
	events  map[string]int
	n       atomic.Int64
	stop    chan struct{} // closed once the run is big enough: scenarios end early
	stopped sync.Once
}

// Session is one worker running one scenario.
type Session struct {
	r       *Runner
	ctx     context.Context
	mu      sync.Mutex // rng is shared by the session's goroutines (Parallel)
	rng     *rand.Rand
	clients []int
	stop    chan struct{} // closed once the run is big enough (the runner's; never, in Quiet)
}

// IntN is a random number in [0, n), from the session's seeded source; safe from the
// session's goroutines.
func (s *Session) IntN(n int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rng.IntN(n)
}

// Run runs scenarios until Mode.Ops operations were recorded and Mode.Duration passed, or
// ctx ends. Every scenario runs at least once (in order) before they are drawn by weight.
func (r *Runner) Run(ctx context.Context) {
	r.mu.Lock()
	if r.ran == nil {
		r.ran, r.events = map[string]int{}, map[string]int{}
	}
	r.mu.Unlock()
	r.stop = make(chan struct{})
	started := time.Now()
	enough := func() bool {
		if ctx.Err() != nil || (r.H.Len() >= r.Mode.Ops && time.Since(started) >= r.Mode.Duration && (r.Also == nil || r.Also())) {
			r.stopped.Do(func() { close(r.stop) })
			return true
		}
		return false
	}
	go func() { // scenarios that sleep see the end too
		for !enough() {
			select {
			case <-r.stop:
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	total := 0
	for _, s := range r.Scenarios {
		total += s.Weight
	}
	var wg sync.WaitGroup
	for w := range r.Mode.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(r.Mode.Seed, uint64(w)))
			clients := []int{r.H.Client(), r.H.Client(), r.H.Client(), r.H.Client()}
			for !enough() {
				n := int(r.n.Add(1)) - 1
				var sc Scenario
				if n < len(r.Scenarios) {
					sc = r.Scenarios[n]
				} else {
					pick := rng.IntN(total)
					for _, s := range r.Scenarios {
						if pick -= s.Weight; pick < 0 {
							sc = s
							break
						}
					}
				}
				sc.Run(&Session{r: r, ctx: ctx, rng: rng, clients: clients, stop: r.stop})
				r.mu.Lock()
				r.ran[sc.Name]++
				r.mu.Unlock()
			}
		}()
	}
	wg.Wait()
}

// Quiet runs each scenario once, all at once (each on a worker of its own), to completion,
// before Run and its faults: the scenarios that probe the contract's time bounds, which a fault
// would blur (a probe must return within a few hundred milliseconds of a bound to tell
// anything), so that every run probes them. Their keys and counts are the run's.
func (r *Runner) Quiet(ctx context.Context, scenarios ...Scenario) {
	r.mu.Lock()
	if r.ran == nil {
		r.ran, r.events = map[string]int{}, map[string]int{}
	}
	r.mu.Unlock()
	stop := make(chan struct{}) // never closed: each scenario runs to its end
	var wg sync.WaitGroup
	for i, sc := range scenarios {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(r.Mode.Seed, uint64(1000+i)))
			clients := []int{r.H.Client(), r.H.Client(), r.H.Client(), r.H.Client()}
			sc.Run(&Session{r: r, ctx: ctx, rng: rng, clients: clients, stop: stop})
			r.mu.Lock()
			r.ran[sc.Name]++
			r.mu.Unlock()
		}()
	}
	wg.Wait()
}

// Keys lists every key the run made.
func (r *Runner) Keys() []Key {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.keys)
}

// Ran is how many times each scenario ran.
func (r *Runner) Ran() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.ran)
}

// Events is how many times each event a scenario noted (Session.Event) happened: a takeover,
// a lost lease, a probe of a key's expiry that came in time.
func (r *Runner) Events() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.events)
}

// Event notes that something a run must do at least so often happened (Runner.Events).
func (s *Session) Event(name string) {
	s.r.mu.Lock()
	defer s.r.mu.Unlock()
	s.r.events[name]++
}

// Observe records the effects under every key (after H.Close).
func (r *Runner) Observe(ctx context.Context) error {
	for _, k := range r.Keys() {
		effects, err := r.Harness.Observe(ctx, k)
		if err != nil {
			return fmt.Errorf("observe %s: %w", k, err)
		}
		r.H.Observe(k.String(), effects)
		if so, ok := r.Harness.(StepObserver); ok {
			steps, err := so.ObserveSteps(ctx, k)
			if err != nil {
				return fmt.Errorf("observe the steps of %s: %w", k, err)
			}
			r.H.ObserveSteps(k.String(), steps)
		}
	}
	return nil
}

// Key makes a new key on this route for the session.
func (s *Session) Key(route Route) Key {
	s.r.mu.Lock()
	defer s.r.mu.Unlock()
	s.mu.Lock()
	rng := rand.New(rand.NewPCG(s.rng.Uint64(), 0))
	s.mu.Unlock()
	k := s.r.Harness.NewKey(rng, fmt.Sprintf("k%d", len(s.r.keys)+1), route)
	s.r.keys = append(s.r.keys, k)
	return k
}

// Request is the key's request number variant.
func (s *Session) Request(k Key, variant int) Request { return s.r.Harness.Request(k, variant) }

// Client is the session's client number i (0 to 3).
func (s *Session) Client(i int) int { return s.clients[i] }

// stopping tells whether the run is big enough: a scenario sends nothing more.
func (s *Session) stopping() bool {
	select {
	case <-s.stop:
		return true
	default:
		return s.ctx.Err() != nil
	}
}

// Send sends r once as client c, recorded in the history; the client gives up after timeout
// (0: the runner's OpTimeout). Once the run is big enough it sends nothing and returns an
// Output whose Outcome is zero (not sent, not recorded).
func (s *Session) Send(c int, r Request, timeout time.Duration) Output {
	if s.stopping() {
		return Output{}
	}
	return s.send(c, r, timeout)
}

// send is Send, whether or not the run is big enough.
func (s *Session) send(c int, r Request, timeout time.Duration) Output {
	if timeout <= 0 {
		timeout = s.r.OpTimeout
	}
	op := s.r.H.Begin(input(c, r))
	ctx, cancel := context.WithTimeout(s.ctx, timeout)
	defer cancel()
	return op.End(s.r.Harness.Send(ctx, c, r))
}

// input is what client c sends for r.
func input(c int, r Request) Input {
	route := r.Key.Route
	if r.RouteSet {
		route = r.Route
	}
	return Input{Key: r.Key.String(), Client: c, Request: r.Text, Fingerprint: r.Fingerprint, Route: route,
		TTL: r.Key.TTL, Lease: r.Key.Lease}
}

// Final tells whether an outcome ends an operation for a client that retries: a decision,
// or a claim it made itself.
func Final(o Outcome) bool {
	switch o {
	case Answered, Replayed, Mismatch, Held, Released, Lost:
		return true
	}
	return false
}

// Until sends r as client c until its outcome is final, at most attempts times, with a
// jittered pause between attempts. The first attempt gives up after first (0: OpTimeout),
// the next ones after OpTimeout.
func (s *Session) Until(c int, r Request, attempts int, first time.Duration) Output {
	var out Output
	for i := range attempts {
		timeout := s.r.OpTimeout
		if i == 0 {
			timeout = first
		}
		if out = s.Send(c, r, timeout); Final(out.Outcome) || s.stopping() {
			return out
		}
		s.Sleep(time.Duration(50+s.IntN(250)) * time.Millisecond)
	}
	return out
}

// Sleep pauses the session (less once the run is big enough).
func (s *Session) Sleep(d time.Duration) {
	select {
	case <-time.After(d):
	case <-s.ctx.Done():
	case <-s.stop:
	}
}

// SleepUntil pauses the session until the history's time t.
func (s *Session) SleepUntil(t time.Duration) { s.Sleep(t - s.r.H.Now()) }

// Now is the history's time.
func (s *Session) Now() time.Duration { return s.r.H.Now() }

// Parallel runs the functions at once and waits for them.
func (s *Session) Parallel(fns ...func()) {
	var wg sync.WaitGroup
	for _, f := range fns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f()
		}()
	}
	wg.Wait()
}
