package dbidem

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Work in steps (Brandur Leach's atomic phases, fenced): the work of a lease claim writes to
// the database in steps, each a transaction of its own that commits the step's writes with its
// recovery point (idem_step, fenced by the claim's token). A takeover of the same generation is
// told the steps recorded (Decision.Steps) and skips them, returning what each saved.

const stepSQL = `SELECT idem.idem_step(p_principal => $1::text, p_key => $2::text, p_attempt => $3::bigint,
       p_step => $4::text, p_saved => $5::jsonb)`

// ErrNoSteps is returned by Step called outside the work of a lease: a lease route's handler,
// DoLease's fn.
var ErrNoSteps = errors.New("idem: Step outside the work of a lease (a lease route's handler or DoLease's fn)")

// ErrStepRecorded: idem_step found the step recorded already in the key's generation (SQLSTATE
// 23505): its writes committed once, and this transaction, which would repeat them, rolled back.
var ErrStepRecorded = errors.New("idem: step recorded already")

// RecordStep records, in q's transaction, that step name of the lease claim with this attempt
// is done, with saved (JSON; nil: null) as what later steps need to know of it (idem_step). Run
// it in the transaction of the step's own writes, last, and commit: they commit together. It
// returns ErrClaimLost when no lease claim with this attempt is in progress (taken over,
// yielded, completed, released): the transaction is aborted and must roll back.
// ErrStepRecorded when the generation recorded the step already, ErrInvalidArgument when the
// steps' saved values would pass 8192 bytes or saved is not JSON that jsonb holds.
func RecordStep(ctx context.Context, q Querier, principal, key string, attempt int64, name string, saved json.RawMessage) error {
	var arg *string
	if saved != nil {
		s := string(saved)
		arg = &s
	}
	_, err := q.Exec(ctx, stepSQL, principal, key, attempt, name, arg)
	return classifyStep(err)
}

// storedStepSQL is the value as the database stores it: jsonb's own text (object members in
// jsonb's order, its spacing, numbers as numeric writes them), which is what a takeover reads
// back (Decision.Steps, idem_recovery); and the rest of the step's transaction bounded idle
// (leaseClaimIdleSQL's setting).
var storedStepSQL = `SELECT $1::jsonb::text, ` + strings.TrimPrefix(leaseClaimIdleSQL, "SELECT ")

// recordStepStored is RecordStep for Step: it returns the saved value as stored, so that the
// attempt that records a step gets the value every later attempt of the generation gets. One
// round trip of two statements: idem_step alone in its statement (Citus delegates a call only
// when it is the statement's one column, and then runs it on the worker under the function's
// own lock timeout), then the stored form with a bound on the rest of the step's transaction idle,
// as a lease claim's own has (leaseClaimIdle): idem_step holds the key's row until the COMMIT
// that follows at once, and a COMMIT lost on the way (a connection that stopped answering)
// otherwise left the server holding the row, every retry of the work told "in progress", until
// its TCP stack noticed, hours later with its defaults (D254). Set only here, after fn: fn may
// call out between its statements with the transaction open.
func recordStepStored(ctx context.Context, tx pgx.Tx, principal, key string, attempt int64, name string, saved json.RawMessage) (json.RawMessage, error) {
	var stored string
	b := &pgx.Batch{}
	b.Queue(stepSQL, principal, key, attempt, name, string(saved))
	b.Queue(storedStepSQL, string(saved)).QueryRow(func(row pgx.Row) error { return row.Scan(&stored, nil) })
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, classifyStep(err)
	}
	return json.RawMessage(stored), nil
}

func classifyStep(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23505" {
		return fmt.Errorf("%w: %w", ErrStepRecorded, err)
	}
	if errors.As(err, &pgErr) && (pgErr.Code == "22P02" || pgErr.Code == "22003" || pgErr.Code == "54001") {
		// The saved value is not JSON that jsonb holds (the one argument cast from text to
		// jsonb): not JSON (22P02), a number past numeric's range (22003), nesting deeper than
		// the server's stack (54001). No retry mends it.
		return fmt.Errorf("%w: the step's saved value is not JSON that PostgreSQL's jsonb holds: %w", ErrInvalidArgument, err)
	}
	return classify(err)
}

// Steps is what Step needs of the work of one lease claim: the pool its transactions run on,
// the claim, the steps recorded in its generation, and the lease to mark lost when a step
// finds the claim taken over. Nil claim: a lease route's request without a key, whose steps
// are transactions without a recovery point.
type Steps struct {
	db      Acquirer
	claim   *LeaseClaim
	lease   *Lease
	opts    TxOptions
	mu      sync.Mutex
	done    map[string]json.RawMessage
	running map[string]bool
	// unsure: the steps whose last try ended without COMMIT's reply (ErrCommitUnknown).
	unsure map[string]bool
}

// NewSteps returns the Steps of the lease claim c (nil: a request without a key), whose
// claim's decision d told the steps recorded so far, and whose heartbeat is l (nil: none).
func NewSteps(db Acquirer, c *LeaseClaim, d Decision, l *Lease, opts TxOptions) *Steps {
	done := make(map[string]json.RawMessage, len(d.Steps))
	for k, v := range d.Steps {
		done[k] = v
	}
	return &Steps{db: db, claim: c, lease: l, opts: opts, done: done, running: map[string]bool{}, unsure: map[string]bool{}}
}

type stepsKey struct{}

// WithSteps returns ctx carrying s, for Step.
func WithSteps(ctx context.Context, s *Steps) context.Context {
	return context.WithValue(ctx, stepsKey{}, s)
}

// Step runs fn once per generation of the lease claim in ctx (WithSteps): in a transaction on
// the claim's pool that commits fn's writes with the step's recovery point (RecordStep, fenced
// by the claim's token), and returns what fn returned; when the generation recorded the step
// already (an earlier attempt did it before it crashed or yielded), it returns the value fn
// saved then, JSON-decoded, without running fn. See idem.Step.
func Step[T any](ctx context.Context, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	var zero T
	s, _ := ctx.Value(stepsKey{}).(*Steps)
	if s == nil {
		return zero, ErrNoSteps
	}
	// The SQL API's rules for a name (idem_step), tested before fn runs: fn may act outside
	// the database, and a name refused after it would make every retry act again.
	if n := utf8.RuneCountInString(name); n == 0 || n > 255 || !utf8.ValidString(name) || strings.IndexByte(name, 0) >= 0 {
		return zero, fmt.Errorf("%w: a step's name must be 1 to 255 characters of UTF-8 without U+0000, got %q", ErrInvalidArgument, name)
	}
	if s.lease != nil && s.lease.TakenOver() {
		// Every Step after one that found the claim taken over fails, a step this attempt
		// recorded before included: the work stops (D176).
		return zero, fmt.Errorf("%w: %w", ErrLeaseLost, ErrClaimLost)
	}
	s.mu.Lock()
	saved, done := s.done[name]
	busy := s.running[name]
	if !done && !busy {
		s.running[name] = true
	}
	s.mu.Unlock()
	if done {
		var v T
		if err := json.Unmarshal(saved, &v); err != nil {
			return zero, fmt.Errorf("idem: step %s: decode its saved value: %w", name, err)
		}
		return v, nil
	}
	if busy {
		return zero, fmt.Errorf("%w: step %s is running already in this attempt", ErrInvalidArgument, name)
	}
	defer func() {
		s.mu.Lock()
		delete(s.running, name)
		s.mu.Unlock()
	}()
	if s.lease != nil && s.lease.Lost() {
		if s.lease.TakenOver() { // the database said so earlier (an extension, a step)
			return zero, fmt.Errorf("%w: %w", ErrLeaseLost, ErrClaimLost)
		}
		return zero, ErrLeaseLost
	}
	s.mu.Lock()
	unsure := s.unsure[name]
	s.mu.Unlock()
	if unsure && s.claim != nil {
		// This step's last try ended without COMMIT's reply (ErrCommitUnknown): it may have
		// landed. The generation's recovery points tell, before fn runs again (D168).
		saved, err := s.recorded(ctx, name)
		if err != nil {
			return zero, err
		}
		if saved != nil {
			s.mu.Lock()
			s.done[name] = saved
			delete(s.unsure, name)
			s.mu.Unlock()
			var v T
			if err := json.Unmarshal(saved, &v); err != nil {
				return zero, fmt.Errorf("idem: step %s: decode its saved value: %w", name, err)
			}
			return v, nil
		}
	}
	var result T
	var raw json.RawMessage
	var commitBound time.Duration
	if s.lease != nil {
		// The step's COMMIT waits at most a lease (and ClaimReplyMargin) for its reply: a
		// connection that stopped answering held the work, the lease extended all along,
		// until its Timeout (D168).
		commitBound = max(s.lease.lease, ClaimReplyMargin)
	}
	// The connection is taken when fn first sends a statement, or for the recovery point
	// after it: fn's calls outside the database hold none.
	var fnFailed bool // the error is fn's own, whatever it wraps (D269)
	err := runTx(ctx, s.db, s.opts, commitBound, true, func(tx *Tx) error {
		fnFailed = false
		var err error
		if result, err = fn(ctx, tx); err != nil {
			fnFailed = true
			return err
		}
		if raw, err = json.Marshal(result); err != nil {
			return fmt.Errorf("%w: idem: step %s: encode its saved value: %w", ErrInvalidArgument, name, err)
		}
		if _, err := roundTrips(result, raw); err != nil {
			// Recorded, it would stop every later attempt of the generation at this step.
			return fmt.Errorf("%w: step %s: its value %w", ErrInvalidArgument, name, err)
		}
		if s.claim == nil {
			return nil // a request without a key: nothing is saved
		}
		if holdsNUL(raw) {
			return fmt.Errorf("%w: step %s: its saved value holds U+0000, which PostgreSQL's jsonb cannot store", ErrInvalidArgument, name)
		}
		if holdsEscape(raw, `\ufffd`) {
			// encoding/json writes each byte of a string that is not UTF-8 as \ufffd (a U+FFFD
			// of valid text as itself): the attempt after a takeover would get another value.
			return fmt.Errorf("%w: step %s: its saved value holds a string that is not UTF-8 (or the escape \\ufffd), "+
				"which would come back changed; save such bytes encoded (base64, hex)", ErrInvalidArgument, name)
		}
		if raw, err = recordStepStored(ctx, tx, s.claim.Principal, s.claim.Key, s.claim.Attempt, name, raw); err != nil {
			return err
		}
		// Every attempt gets the stored form (below): one that T cannot decode (an
		// UnmarshalJSON that wants the text as fn's JSON wrote it) would stop each of them at
		// this step, this one included, so it is refused before the step commits.
		if err := json.Unmarshal(raw, new(T)); err != nil {
			return fmt.Errorf("%w: step %s: its value as PostgreSQL's jsonb stores it (%.64s) does not decode into %T: %w",
				ErrInvalidArgument, name, raw, result, err)
		}
		return nil
	})
	if err != nil && !fnFailed && errors.Is(err, ErrCommitUnknown) && s.claim != nil {
		s.mu.Lock()
		s.unsure[name] = true
		s.mu.Unlock()
	}
	switch {
	case errors.Is(err, ErrClaimLost) && !fnFailed:
		// Taken over (or yielded, completed): this step's writes rolled back, and the work
		// stops; the lease's holder (a lease route, DoLease) does not record its answer. Only
		// the step's own fencing says so: fn's error that wraps ErrClaimLost (another claim's,
		// from a call of its own) is fn's failure, and this lease stands (D269).
		if s.lease != nil {
			s.lease.lose(true)
		}
		return zero, fmt.Errorf("%w: %w", ErrLeaseLost, err)
	case err != nil && s.lease != nil && s.lease.Lost() && (!fnFailed || ctx.Err() != nil):
		// The lease was lost while the step ran (an extension found the claim taken over, or
		// its end passed by this process's clock), and the step failed with it: its recording,
		// or fn once its context ended (context.Canceled, a statement cut). The error says the
		// lease's loss, as every later Step does: ErrClaimLost only when the claim was taken
		// over (D269). fn's failure of its own while the lease runs out is fn's, as it is.
		if s.lease.TakenOver() && !errors.Is(err, ErrClaimLost) {
			err = fmt.Errorf("%w: %w", ErrClaimLost, err)
		}
		if !errors.Is(err, ErrLeaseLost) {
			err = fmt.Errorf("%w: %w", ErrLeaseLost, err)
		}
		return zero, err
	case err != nil:
		return zero, err
	}
	s.mu.Lock()
	s.done[name] = raw
	delete(s.unsure, name)
	s.mu.Unlock()
	// The value as stored, not as fn returned it: jsonb keeps the JSON value, not its text
	// (a json.RawMessage's member order, a json.Number's exponent), and a takeover gets the
	// stored form; so does this attempt, now and when it asks for the step again. A request
	// without a key saves nothing, and gets fn's value through its JSON, as again later.
	var v T
	if err := json.Unmarshal(raw, &v); err != nil {
		return zero, fmt.Errorf("idem: step %s: decode its saved value: %w", name, err)
	}
	return v, nil
}

// recorded reads the value the step name saved in this claim's generation, nil when it is not
// recorded (idem_recovery). Its earlier try's transaction may still hold the key's row, its
// COMMIT on its way (abandoned when its context ended, its reply lost): a plain read would not
// see it and fn would run again. So the read comes after an extension of the lease in the same
// transaction, which takes the row's lock and so waits for that transaction's end (its lock
// timeout at most: the outcome is then still unknown, and fn is not run). A claim no longer
// this attempt's loses the lease.
func (s *Steps) recorded(ctx context.Context, name string) (json.RawMessage, error) {
	var saved []byte
	err := RunTx(ctx, s.db, TxOptions{MaxAttempts: 1}, func(tx *Tx) error {
		if s.lease != nil {
			if _, err := Extend(ctx, tx, s.claim.Principal, s.claim.Key, s.claim.Attempt, s.lease.lease); err != nil {
				return err
			}
		}
		return classify(tx.QueryRow(ctx, `SELECT r.recovery_saved -> $4 FROM idem.idem_recovery($1, $2, $3) AS r`,
			s.claim.Principal, s.claim.Key, s.claim.Attempt, name).Scan(&saved))
	})
	switch {
	case errors.Is(err, ErrClaimLost):
		if s.lease != nil {
			s.lease.lose(true)
		}
		return nil, fmt.Errorf("%w: %w", ErrLeaseLost, err)
	case errors.Is(err, ErrInProgress) || isLockTimeout(err):
		return nil, fmt.Errorf("%w: step %s: its earlier COMMIT still holds the key's row; the step is not run again until its outcome is known: %w",
			ErrCommitUnknown, name, err)
	case err != nil:
		return nil, fmt.Errorf("idem: step %s: read whether it was recorded: %w", name, err)
	}
	return saved, nil
}

// holdsNUL tells whether the JSON text b holds the escape \u0000 (a string with U+0000, which
// jsonb refuses), not counting a literal backslash before "u0000" (escaped as \\).
func holdsNUL(b []byte) bool { return holdsEscape(b, `\u0000`) }

// holdsEscape tells whether the JSON text b holds the escape esc (a backslash and what
// follows), not counting a literal backslash before the rest (escaped as \\).
func holdsEscape(b []byte, esc string) bool {
	for i := bytes.Index(b, []byte(esc)); i >= 0; {
		n := 0 // the backslashes that end at i, i's own included
		for j := i; j >= 0 && b[j] == '\\'; j-- {
			n++
		}
		if n%2 == 1 {
			return true
		}
		next := bytes.Index(b[i+1:], []byte(esc))
		if next < 0 {
			return false
		}
		i += 1 + next
	}
	return false
}
