package history

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
)

// The Go library, public package idem: Do (the work in the claim's transaction) and DoLease
// (the work outside the database under a lease, a provider called with the claim's provider
// key), from clients that each have a Gate of their own, as separate processes would.

// errInjected is the failure a job's work returns when the scenario asks for one.
var errInjected = errors.New("history: the work failed (injected)")

type doHarness struct {
	pool, observe *pgxpool.Pool

	mu    sync.Mutex
	gates map[int]*idem.Gate
}

// doInput is a job's input (fingerprinted); doResult its stored result.
type doInput struct {
	Amount int `json:"amount"`
}

type doResult struct {
	Effect      int64  `json:"effect,omitempty"`
	Ref         string `json:"ref,omitempty"`
	ProviderKey string `json:"provider_key,omitempty"`
	Amount      int    `json:"amount"`
	Steps       string `json:"steps,omitempty"` // stepped work: each step's row, "a=12,b=13"
}

func (h *doHarness) gate(c int) *idem.Gate {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.gates[c] == nil {
		h.gates[c] = idem.NewGate(idem.GateOptions{})
	}
	return h.gates[c]
}

func (h *doHarness) NewKey(rng *rand.Rand, name string, route Route) Key {
	return Key{Principal: []string{"alice", "bob"}[rng.IntN(2)], Name: name, Route: route, TTL: 2 * time.Second, Lease: time.Second}
}

func (h *doHarness) Request(k Key, variant int) Request {
	in := doInput{Amount: 100 * (variant + 1)}
	return Request{Key: k, Variant: variant, Fingerprint: fmt.Sprintf("hist.pay %d", in.Amount),
		Text: fmt.Sprintf("job amount=%d", in.Amount), Payload: in}
}

func (h *doHarness) Send(ctx context.Context, c int, r Request) Output {
	in := r.Payload.(doInput)
	job := idem.Job{Principal: r.Key.Principal, Key: r.Key.Name, Action: "hist.pay", Input: in, TTL: r.Key.TTL,
		LockTimeout: 300 * time.Millisecond, Gate: h.gate(c), Lease: r.Key.Lease}
	route := r.Key.Route
	if r.RouteSet {
		route = r.Route
	}
	var (
		res      doResult
		replayed bool
		err      error
		pk       string
		worked   time.Time // when the work returned: its result is stored after
		ran      bool      // the work began: the claim was made
	)
	if route == Transactional {
		res, replayed, err = idem.Do(ctx, h.pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (doResult, error) {
			ran = true
			var id int64
			if err := tx.QueryRow(ctx, `INSERT INTO hist.effects (principal, key, fingerprint, attempt) VALUES ($1, $2, $3, 0)
				RETURNING id`, r.Key.Principal, r.Key.Name, r.Fingerprint).Scan(&id); err != nil {
				return doResult{}, err
			}
			if r.Release {
				return doResult{}, errInjected
			}
			if err := work(ctx, r, 0, 0); err != nil { // the claim and the answer apart
				return doResult{}, err
			}
			worked = time.Now()
			return doResult{Effect: id, Amount: in.Amount}, nil
		})
	} else {
		res, replayed, err = idem.DoLease(ctx, h.pool, job, func(ctx context.Context, claim idem.LeaseClaim) (doResult, error) {
			ran, pk = true, claim.ProviderKey
			if r.Stepped {
				// Work in steps: each step writes a row of its generation; a Release request
				// fails between the two (its lease is given up), and its retry goes on.
				var named []string
				for i, name := range []string{"a", "b"} {
					id, err := idem.Step(ctx, name, func(ctx context.Context, tx pgx.Tx) (int64, error) {
						var id int64
						err := tx.QueryRow(ctx, `INSERT INTO hist.steps (principal, key, pk, step) VALUES ($1, $2, $3, $4)
							RETURNING id`, r.Key.Principal, r.Key.Name, claim.ProviderKey, name).Scan(&id)
						return id, err
					})
					if err != nil {
						return doResult{}, err
					}
					named = append(named, fmt.Sprintf("%s=%d", name, id))
					if i == 0 && r.Release {
						return doResult{}, errInjected
					}
					if err := work(ctx, r, 20*time.Millisecond, 150*time.Millisecond); err != nil {
						return doResult{}, context.Cause(ctx)
					}
				}
				worked = time.Now()
				return doResult{ProviderKey: claim.ProviderKey, Amount: in.Amount, Steps: strings.Join(named, ",")}, nil
			}
			if r.Hold {
				// Long work without an outside effect (Do may take the job over if the lease
				// dies, and its effect is a row): long enough for a fault to lose the lease.
				select {
				case <-time.After(time.Duration(800+rand.IntN(700)) * time.Millisecond):
				case <-ctx.Done():
					return doResult{}, context.Cause(ctx)
				}
				worked = time.Now()
				return doResult{ProviderKey: claim.ProviderKey, Amount: in.Amount}, nil
			}
			var ref string
			if r.Release && rand.IntN(2) == 0 {
				return doResult{}, errInjected // before the provider
			}
			if err := h.pool.QueryRow(ctx, providerCall, claim.ProviderKey, r.Key.Principal, r.Key.Name).Scan(&ref); err != nil {
				return doResult{}, err
			}
			if r.Release {
				return doResult{}, errInjected // after the provider
			}
			if err := work(ctx, r, 20*time.Millisecond, 150*time.Millisecond); err != nil {
				return doResult{}, context.Cause(ctx)
			}
			worked = time.Now()
			return doResult{Ref: ref, ProviderKey: claim.ProviderKey, Amount: in.Amount}, nil
		})
	}
	var connect *pgconn.ConnectError
	switch {
	case err != nil && !ran && errors.As(err, &connect):
		// No connection for the claim: nothing was sent (a Do's work runs on the claim's
		// connection, so a connect error after the claim is not this one).
		return Output{Outcome: NotSent, Note: err.Error()}
	case err == nil:
		body, _ := json.Marshal(res)
		out := Output{Outcome: Answered, Status: 200, Body: string(body), ProviderKey: res.ProviderKey, StoreSent: worked,
			Steps: res.Steps}
		if replayed {
			out.Outcome, out.StoreSent = Replayed, time.Time{}
		}
		switch {
		case res.Effect != 0:
			out.Effect = fmt.Sprintf("row %d", res.Effect)
		case res.Ref != "":
			out.Effect = "payout " + res.Ref
		}
		return out
	case errors.Is(err, idem.ErrMismatch):
		return Output{Outcome: Mismatch}
	case errors.Is(err, idem.ErrInProgress):
		return Output{Outcome: Busy, Note: err.Error()}
	case errors.Is(err, idem.ErrLeaseLost):
		return Output{Outcome: Lost, ProviderKey: pk, Note: err.Error()}
	case errors.Is(err, errInjected) && route == Leased:
		return Output{Outcome: Released, ProviderKey: pk, Note: err.Error()}
	case errors.Is(err, errInjected):
		return Output{Outcome: Failed, Note: err.Error()} // rolled back
	case route == Transactional && ctx.Err() == nil && !errors.Is(err, idem.ErrCommitUnknown):
		return Output{Outcome: Failed, Note: err.Error()}
	}
	return Output{Outcome: Unknown, ProviderKey: pk, Note: err.Error()}
}

func (h *doHarness) Observe(ctx context.Context, k Key) ([]string, error) {
	rows, err := h.observe.Query(ctx, `SELECT 'row ' || id FROM hist.effects WHERE principal = $1 AND key = $2
		UNION ALL SELECT 'payout ' || ref FROM hist.provider WHERE principal = $1 AND key = $2`, k.Principal, k.Name)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// ObserveSteps reports the rows the stepped work wrote under k (StepObserver).
func (h *doHarness) ObserveSteps(ctx context.Context, k Key) ([]StepEffect, error) {
	rows, err := h.observe.Query(ctx, `SELECT pk, step, id::text FROM hist.steps WHERE principal = $1 AND key = $2`,
		k.Principal, k.Name)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (StepEffect, error) {
		var e StepEffect
		err := row.Scan(&e.ProviderKey, &e.Step, &e.ID)
		return e, err
	})
}

// steppedLease: DoLease whose work is two steps (idem.Step), each writing a row; half the time
// a first attempt fails between them (its lease is given up), then two clients retry the job
// at once while faults cut, stall and kill.
func steppedLease(weight int) Scenario {
	return Scenario{Name: "steps", Weight: weight, Run: func(s *Session) {
		k := s.Key(Leased)
		r := s.Request(k, 0)
		r.Stepped = true
		if s.IntN(2) == 0 {
			fail := r
			fail.Release = true
			s.Until(s.Client(0), fail, 1, 0)
		}
		s.Parallel(
			func() { s.Until(s.Client(1), r, 4, 0) },
			func() { s.Sleep(time.Duration(s.IntN(300)) * time.Millisecond); s.Until(s.Client(2), r, 4, 0) },
		)
	}}
}

// leaseThenDo: a DoLease whose work is long (a fault may lose its lease meanwhile), and the
// same job through Do after its lease's end (it takes a dead lease over); then a repeat a
// little later.
func leaseThenDo(weight int) Scenario {
	return Scenario{Name: "DoLease then Do", Weight: weight, Run: func(s *Session) {
		k := s.Key(Leased)
		long := s.Request(k, 0)
		long.Hold = true
		tx := s.Request(k, 0)
		tx.Route, tx.RouteSet = Transactional, true
		var first Output
		s.Parallel(
			func() { first = s.Until(s.Client(0), long, 2, 0) },
			func() { s.Sleep(k.Lease + 200*time.Millisecond); s.Until(s.Client(1), tx, 4, 0) },
		)
		s.Sleep(time.Duration(500+s.IntN(1500)) * time.Millisecond)
		s.Until(s.Client(2), tx, 3, 0)
		_ = first
	}}
}

// failedLeaseReuse: DoLease whose work fails (its lease is given up: Yield), then the key used
// again at once, by the same job or another.
func failedLeaseReuse(weight int) Scenario {
	return Scenario{Name: "failed lease, then reuse", Weight: weight, Run: func(s *Session) {
		k := s.Key(Leased)
		fail := s.Request(k, 0)
		fail.Release = true
		if out := s.Until(s.Client(0), fail, 2, 0); out.Outcome != Released {
			return
		}
		next := s.Request(k, s.IntN(2))
		s.Until(s.Client(1), next, 3, 0)
		s.Until(s.Client(2), next, 2, 0)
	}}
}

// TestDoHistory: Do and DoLease from clients with a Gate each, through a fault proxy, while
// connections are cut, slowed and stalled, backends killed, the key table locked and
// PostgreSQL restarted; every call is checked against the model.
func TestDoHistory(t *testing.T) {
	t.Parallel()
	mode := ModeFromEnv(200, 6*time.Second, 8)
	c, observe, proxy := historyDB(t)
	ctx := context.Background()
	const app = "hist-do"
	cfg, err := pgxpool.ParseConfig(Via(proxy.Addr(), "hist") + " application_name=" + app + " connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 24
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	harness := &doHarness{pool: pool, observe: observe, gates: map[int]*idem.Gate{}}

	h := New()
	inj := NewInjector(h)
	inj.ProxyFaults(proxy)
	inj.LockFault(c.URL("hist"))
	inj.TerminateFault(c.URL("hist"), app)
	inj.RestartFault(c)
	if mode.Long { // a failover to a synchronous standby (docs/testing.md)
		c.WithStandby(t)
		inj.PromotionFault(c)
	}
	inj.CommitFault(c.URL("hist"), app)
	runner := &Runner{H: h, Harness: harness, Mode: mode, Also: inj.Covered, OpTimeout: 2 * time.Second, Scenarios: []Scenario{
		Expiry(Leased, 2), failedLeaseReuse(2), leaseThenDo(2), steppedLease(2), Storm(Transactional, 3), Storm(Leased, 3),
		Changed(Transactional, 2), Changed(Leased, 2), Hangup(Transactional, 2), Hangup(Leased, 2), Expiry(Transactional, 2),
		Duplicate(Transactional, 50*time.Millisecond, 8*time.Second, 1), Duplicate(Leased, 50*time.Millisecond, 8*time.Second, 1),
		ExpiryEdge(Transactional, edgeWork, edgeTTL, 1), ExpiryEdge(Leased, edgeWork, edgeTTL, 1),
	}}
	t.Logf("seed %d (HISTORY_SEED), at least %d operations and %s", mode.Seed, mode.Ops, mode.Duration)
	cleanCtx, stopCleanup := context.WithCancel(ctx)
	cleanups := CleanupEvery(cleanCtx, observe, cleanupEvery)
	runFaults(t, h, inj, runner, mode, ExpiryEdge(Transactional, edgeWork, edgeTTL, 0), ExpiryEdge(Leased, edgeWork, edgeTTL, 0),
		ExpiryEdge(Transactional, edgeWork, edgeTTL, 0), ExpiryEdge(Leased, edgeWork, edgeTTL, 0), Changed(Transactional, 0),
		Changed(Leased, 0), failedLeaseReuse(0), steppedLease(0))
	probeEdgesAgain(ctx, runner)
	outcomeAgain(ctx, h, runner, "mismatch", 3, Changed(Transactional, 0))
	stopCleanup()
	time.Sleep(2*time.Second + 500*time.Millisecond) // a lease's completion outlives its client by a lease at most
	pool.Close()
	waitIdle(t, observe, app)
	h.Close()
	if err := runner.Observe(ctx); err != nil {
		t.Fatal(err)
	}
	Verify(t, h, t.Name())
	t.Logf("scenarios: %v", runner.Ran())
	stepped, rows := 0, 0
	for _, op := range h.Operations() {
		if o, ok := op.Output.(Output); ok && o.Steps != "" {
			stepped++
		}
	}
	for _, es := range h.Steps() {
		rows += len(es)
	}
	t.Logf("work in steps: %d answers naming their step rows checked against %d step rows observed", stepped, rows)
	if stepped == 0 {
		t.Error("no answer of work in steps was checked")
	}
	outcomes, faults := h.Counts()
	// At least: enough of each for the model to have something to check; on a loaded machine
	// (two cores, the other packages' tests beside it) a short run completes fewer operations.
	Require(t, "the outcome", outcomes, map[string]int{"2xx": 10, "replayed": 5, "mismatch": 3, "released": 1, "busy": 1})
	Require(t, "the fault", faults, map[string]int{"cut": 1, "latency": 1, "stall": 1, "table-lock": 1, "backend-kill": 1, "pg-restart": 1,
		"commit-kill": 1})
	Require(t, "the scenario", runner.Ran(), map[string]int{"DoLease then Do": 1, "failed lease, then reuse": 1, "steps": 1,
		"expiry lease": 1, "storm tx": 1, "storm lease": 1, "duplicate tx": 1, "duplicate lease": 1, "expiry edge tx": 2,
		"expiry edge lease": 2})
	requireEdges(t, h, runner, cleanups(), false)
}
