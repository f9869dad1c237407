package dbidem

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The statements. Every parameter is cast, and JSON goes as text, so the same statements work
// without prepared-statement descriptions (PgBouncer in transaction mode, QueryExecModeExec).
// Those modes read every result as text, in the session's output settings, which a role or a
// database may change (D231): no statement reads a timestamp, an interval or a float as text
// (each comes as whole microseconds, a bigint: see microsSQL), and a bytea is read as anyBytea
// (hex or escape). BeginSQL and CompleteSQL are exported for tools that must pipeline them by
// hand (the benchmark's variant without a savepoint); their arguments are those of Begin and
// Complete, in that order, durations as intervals, JSON as text.
const (
	// BeginSQL calls idem_begin and returns its row (a transactional claim's statement).
	BeginSQL = `SELECT outcome, attempt, response_status, response_headers, response_body, resource_id,
       withheld, changed_fields, (extract(epoch FROM retry_after) * 1000000)::bigint, provider_key
  FROM idem.idem_begin(p_principal => $1::text, p_key => $2::text, p_action => $3::text,
                       p_request_sha256 => $4::bytea, p_ttl => $5::interval, p_lease => $6::interval,
                       p_request_fields => $7::jsonb, p_lock_timeout => $8::interval)`

	// BeginRecordSQL is BeginSQL with idem_begin called in the select list: its row comes
	// back as one composite value (decisionRow.record), which spares the server the function
	// scan's tuple store and the projection of ten columns (about 50,000 instructions of a
	// replay's 350,000: docs/benchmarks.md). A record can be read in the binary format only,
	// so it serves the modes that describe a statement before they run it (binaryResults);
	// the others (QueryExecModeExec, the simple protocol: PgBouncer in transaction mode) send
	// BeginSQL.
	BeginRecordSQL = `SELECT idem.idem_begin(p_principal => $1::text, p_key => $2::text, p_action => $3::text,
       p_request_sha256 => $4::bytea, p_ttl => $5::interval, p_lease => $6::interval,
       p_request_fields => $7::jsonb, p_lock_timeout => $8::interval)`

	// beginStepsSQL is BeginSQL through idem_begin_steps: the steps its generation recorded
	// (idem_recovery) come with a claim, in the same call; a lease claim's statement, Begin's
	// and Do's. One function in FROM, so that Citus delegates the call, with its lock timeout,
	// to the principal's worker (D139).
	beginStepsSQL = `SELECT b.outcome, b.attempt, b.response_status, b.response_headers, b.response_body,
       b.resource_id, b.withheld, b.changed_fields, (extract(epoch FROM b.retry_after) * 1000000)::bigint,
       b.provider_key, b.recovery_point, b.recovery_saved
  FROM idem.idem_begin_steps(p_principal => $1::text, p_key => $2::text, p_action => $3::text,
                             p_request_sha256 => $4::bytea, p_ttl => $5::interval, p_lease => $6::interval,
                             p_request_fields => $7::jsonb, p_lock_timeout => $8::interval) AS b`

	// CompleteSQL calls idem_complete.
	CompleteSQL = `SELECT idem.idem_complete(p_principal => $1::text, p_key => $2::text, p_attempt => $3::bigint,
       p_status => $4::integer, p_headers => $5::jsonb, p_body => $6::bytea,
       p_resource_id => $7::text, p_withheld => $8::text)`

	saveFinalSQL = `SELECT idem.idem_save_final(p_principal => $1::text, p_key => $2::text,
       p_action => $3::text, p_request_sha256 => $4::bytea, p_ttl => $5::interval,
       p_status => $6::integer, p_headers => $7::jsonb, p_body => $8::bytea,
       p_request_fields => $9::jsonb, p_withheld => $10::text, p_resource_id => $11::text)`

	releaseSQL = `SELECT idem.idem_release(p_principal => $1::text, p_key => $2::text, p_attempt => $3::bigint)`

	yieldSQL = `SELECT idem.idem_yield(p_principal => $1::text, p_key => $2::text, p_attempt => $3::bigint)`

	cleanupSQL = `SELECT idem.idem_cleanup(p_batch_size => $1::integer)`

	// CleanupWorkersSQL is one pass of idem_cleanup_workers as one array, {deleted, done (0
	// or 1)}: NULL where the database has no workers to ask (it returns no row there).
	CleanupWorkersSQL = `SELECT (SELECT ARRAY[w.deleted, w.done::integer]
	  FROM idem.idem_cleanup_workers(p_batch_size => $1::integer, p_duty => $2::float8, p_max_time => $3::interval) AS w)`

	defaultsSQL = `SELECT (extract(epoch FROM ttl) * 1000000)::bigint, (extract(epoch FROM lock_timeout) * 1000000)::bigint, batch_size
  FROM idem.idem_defaults()`
)

// interval is a duration as an interval parameter; 0 is NULL, the function's default. It is
// sent in whole microseconds, rounded away from zero: below a microsecond it stays positive
// (truncated, it was 0, which the functions refuse), and a negative one stays negative, so that
// the functions' refusal names it (-1ns was refused as "got 00:00:00").
func interval(d time.Duration) *string {
	if d == 0 {
		return nil
	}
	us := d.Microseconds()
	if d%time.Microsecond > 0 {
		us++
	} else if d%time.Microsecond < 0 {
		us--
	}
	s := fmt.Sprintf("%d microseconds", us)
	return &s
}

func fieldsJSON(f map[string]string) *string {
	if f == nil {
		return nil
	}
	b, _ := json.Marshal(f)
	s := string(b)
	return &s
}

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// encodeHeader stores one string per header name, so that a replay writes the same bytes as
// the first answer (D166): a header sent on several lines is stored as U+0002 followed by its
// lines joined by a line feed, which no line can hold (net/http writes a carriage return or
// line feed inside a value as a space, so each line is stored as it goes out); a line that
// JSON text cannot hold byte for byte (bytes that are not UTF-8, U+0000) is stored as U+0001
// followed by one character per byte, U+0100 plus the byte, as is a line that begins with
// U+0001 or U+0002 (which no valid header value does). A single line of UTF-8 text, the usual
// case, is stored as it is, as the previous release stored it; a string without the leading
// U+0002, whatever it holds, is one line (a row of the previous release, which stored a line
// feed of a value as it was: net/http sent it as a space, and sends it so again). A name with
// no line (a handler's w.Header()["Content-Type"] = nil, which keeps net/http from adding a
// Content-Type of its own) is stored as U+0001 alone, which no line is stored as (an empty line
// is the empty string), and read back as the name with no line (D265).
func encodeHeader(h http.Header) string {
	m := make(map[string]string, len(h))
	for k, v := range h {
		if len(v) == 0 {
			m[k] = noLine
			continue
		}
		lines := make([]string, len(v))
		for i, line := range v {
			line = headerNewlineToSpace.Replace(line)
			if !utf8.ValidString(line) || strings.IndexByte(line, 0) >= 0 || strings.HasPrefix(line, "\x01") || strings.HasPrefix(line, "\x02") {
				var b strings.Builder
				b.WriteByte(1)
				for j := 0; j < len(line); j++ {
					b.WriteRune(0x100 + rune(line[j]))
				}
				line = b.String()
			}
			lines[i] = line
		}
		if len(lines) == 1 {
			m[k] = lines[0]
		} else {
			m[k] = "\x02" + strings.Join(lines, "\n")
		}
	}
	b, _ := json.Marshal(m)
	return string(b)
}

// noLine is the stored form of a header name with no line.
const noLine = "\x01"

// headerNewlineToSpace is what net/http does to a line feed or carriage return in a header
// value as it writes it.
var headerNewlineToSpace = strings.NewReplacer("\n", " ", "\r", " ")

// decodeHeader reads a stored answer's headers: an object of strings (the functions accept
// nothing else), or NULL, read as none; each string as encodeHeader wrote it (a string written
// by another client or the previous release, with no leading U+0001 or U+0002, is one line as
// it is; U+0001 alone is the name with no line).
func decodeHeader(b []byte) (http.Header, error) {
	if b == nil {
		return http.Header{}, nil
	}
	var m map[string]string
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("idem: stored headers: %w", err)
	}
	h := make(http.Header, len(m))
	for k, v := range m {
		if v == noLine {
			h[k] = []string{}
			continue
		}
		lines := []string{v}
		if rest, ok := strings.CutPrefix(v, "\x02"); ok {
			lines = strings.Split(rest, "\n")
		}
		for i, line := range lines {
			lines[i] = decodeHeaderLine(line)
		}
		h[k] = lines
	}
	return h, nil
}

// decodeHeaderLine undoes encodeHeader's form of a line that JSON text cannot hold; a line in
// no such form is returned as it is.
func decodeHeaderLine(line string) string {
	if !strings.HasPrefix(line, "\x01") {
		return line
	}
	out := make([]byte, 0, len(line)/2)
	for _, r := range line[1:] {
		if r < 0x100 || r > 0x1ff {
			return line
		}
		out = append(out, byte(r-0x100))
	}
	return string(out)
}

// standbyWaitColumn, a last column of the claim's statement in RunTx (Tx.Claim), tells whether
// this transaction's COMMIT may wait for a synchronous standby: synchronous_standby_names is set
// (whatever the session's synchronous_commit, which the work may still change with SET LOCAL),
// or Citus is loaded (its coordinator commits on workers whose settings it does not show). Only
// such a COMMIT must never be canceled (D108); the others RunTx sends on the caller's context.
// Citus is told by citus.version, which every role may read (citus.node_conninfo, read here
// before, is a superuser's: every claim of the application role failed with 42501 on Citus).
const standbyWaitColumn = `,
       current_setting('synchronous_standby_names') <> ''
       OR current_setting('citus.version', true) IS NOT NULL`

// txBeginSQL and txBeginStepsSQL are BeginSQL and beginStepsSQL with standbyWaitColumn.
var (
	txBeginSQL      = withColumn(BeginSQL, standbyWaitColumn)
	txBeginStepsSQL = withColumn(beginStepsSQL, standbyWaitColumn)
)

// standbyWaitSQL is standbyWaitColumn as a statement of its own, queued right after
// BeginRecordSQL in the same round trip. BeginRecordSQL must stay the call alone: Citus
// delegates `SELECT idem.idem_begin(...)` (and `SELECT ... FROM idem.idem_begin(...)`) to the
// principal's worker, but not a select list with anything beside the call, which it then runs
// on the coordinator, where the function's lock_timeout does not reach the worker's statements:
// a claim of a held key waited on the worker without end (TestCitusErrorForms).
var standbyWaitSQL = "SELECT" + strings.TrimPrefix(standbyWaitColumn, ",")

// binaryResults tells whether conn's statements get their results in the binary format (the
// modes that describe a statement first), which a record (BeginRecordSQL) needs.
func binaryResults(conn *pgx.Conn) bool {
	switch conn.Config().DefaultQueryExecMode {
	case pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec:
		return true
	}
	return false
}

// withColumn adds column (text that starts with a comma) to the select list of stmt, a
// statement whose FROM starts a line.
func withColumn(stmt, column string) string {
	i := strings.Index(stmt, "\n  FROM ")
	return stmt[:i] + column + stmt[i:]
}

// queueTxBegin queues c's claim in RunTx on conn: a lease claim, or one whose caller reads the
// steps (steps), through beginStepsSQL; otherwise BeginSQL, or, where conn reads records,
// BeginRecordSQL and then standbyWaitSQL; each with standbyWaitColumn. The decision goes to r,
// the standby's column to standbyWait.
func (c Claim) queueTxBegin(b *pgx.Batch, conn *pgx.Conn, steps bool, r *decisionRow, standbyWait *bool) {
	scan := func(dest ...any) func(pgx.Row) error {
		return func(row pgx.Row) error { return row.Scan(dest...) }
	}
	switch {
	case c.Lease != 0 || steps:
		b.Queue(txBeginStepsSQL, c.beginArgs()...).QueryRow(scan(append(r.dest(true), standbyWait)...))
	case binaryResults(conn):
		b.Queue(BeginRecordSQL, c.beginArgs()...).QueryRow(scan(r.record()))
		b.Queue(standbyWaitSQL).QueryRow(scan(standbyWait))
	default:
		b.Queue(txBeginSQL, c.beginArgs()...).QueryRow(scan(append(r.dest(false), standbyWait)...))
	}
}

func (c Claim) beginArgs() []any {
	return []any{c.Principal, c.Key, c.Action, c.Fingerprint[:], interval(c.TTL), interval(c.Lease),
		fieldsJSON(c.Fields), interval(c.LockTimeout)}
}

func completeArgs(principal, key string, attempt int64, r Response) []any {
	return []any{principal, key, attempt, r.Status, encodeHeader(r.Header), r.Body, nullable(r.ResourceID), nullable(r.Withheld)}
}

func saveFinalArgs(c Claim, r Response) []any {
	return []any{c.Principal, c.Key, c.Action, c.Fingerprint[:], interval(c.TTL), r.Status, encodeHeader(r.Header),
		r.Body, fieldsJSON(c.Fields), nullable(r.Withheld), nullable(r.ResourceID)}
}

// decisionRow scans idem_begin's row.
type decisionRow struct {
	d        Decision
	outcome  string
	status   *int32
	headers  []byte
	body     []byte
	resource *string
	withheld *string
	retry    *int64 // retry_after in microseconds
	provider *string
	point    *string
	saved    []byte
	interval pgtype.Interval // retry_after, read from a record
}

// dest is where the row of BeginSQL goes; with steps, the row of beginStepsSQL.
func (r *decisionRow) dest(steps bool) []any {
	d := []any{&r.outcome, &r.d.Attempt, &r.status, &r.headers, (*anyBytea)(&r.body), &r.resource, &r.withheld,
		&r.d.ChangedFields, &r.retry, &r.provider}
	if steps {
		d = append(d, &r.point, &r.saved)
	}
	return d
}

// record is where the row of BeginRecordSQL goes: idem_begin's columns, retry_after as an
// interval.
func (r *decisionRow) record() pgtype.CompositeFields {
	return pgtype.CompositeFields{&r.outcome, &r.d.Attempt, &r.status, &r.headers, &r.body, &r.resource, &r.withheld,
		&r.d.ChangedFields, &r.interval, &r.provider}
}

func (r *decisionRow) decision() (Decision, error) {
	if r.interval.Valid {
		// extract(epoch FROM retry_after) in microseconds, as BeginSQL reads it: a month is
		// 365.25/12 days.
		us := r.interval.Microseconds + int64(r.interval.Days)*86400e6 + int64(float64(r.interval.Months)*(365.25/12)*86400e6)
		r.retry = &us
	}
	d := r.d
	d.Outcome = Outcome(r.outcome)
	if r.status != nil {
		d.Response.Status = int(*r.status)
		d.Response.Body = r.body
		h, err := decodeHeader(r.headers)
		if err != nil {
			return Decision{}, err
		}
		d.Response.Header = h
		if r.resource != nil {
			d.Response.ResourceID = *r.resource
		}
		if r.withheld != nil {
			d.Response.Withheld = *r.withheld
		}
	}
	if r.retry != nil {
		d.RetryAfter = time.Duration(*r.retry) * time.Microsecond
	}
	if r.provider != nil {
		d.ProviderKey = *r.provider
	}
	if r.point != nil {
		d.RecoveryPoint = *r.point
	}
	if r.saved != nil {
		if err := json.Unmarshal(r.saved, &d.Steps); err != nil {
			return Decision{}, fmt.Errorf("idem: recorded steps: %w", err)
		}
	}
	return d, nil
}

// Begin claims c.Key for c.Principal in q's transaction, or returns the decision about the
// row that holds it. With a transactional claim (Lease 0) the transaction must complete
// the claim (Complete, or SaveFinal after rolling the work back) before it commits. Inside
// RunTx prefer Tx.Claim, which saves a round trip.
func Begin(ctx context.Context, q Querier, c Claim) (Decision, error) {
	var row decisionRow
	row.d.Sent = time.Now()
	if err := q.QueryRow(ctx, beginStepsSQL, c.beginArgs()...).Scan(row.dest(true)...); err != nil {
		return Decision{}, claimError(ctx, err)
	}
	return row.decision()
}

// Complete stores r as the response of the claim with this attempt. It returns
// ErrClaimLost when that claim is no longer in progress (fencing). Inside RunTx prefer
// Tx.CompleteOnCommit, which saves a round trip.
//
// On a pool, or on a connection outside a transaction, the statement commits on its own, and
// no context of the caller's ever cancels it (sendCommitting, D165).
func Complete(ctx context.Context, q Querier, principal, key string, attempt int64, r Response) error {
	_, err := sendCommitting(ctx, q, func(ctx context.Context, q Querier) (pgconn.CommandTag, error) {
		return q.Exec(ctx, CompleteSQL, completeArgs(principal, key, attempt, r)...)
	})
	return classify(err)
}

// sendCommitting sends, through send, a statement on q that stores an answer. When it commits
// on its own (q is a pool, or a connection outside a transaction) and ctx can end, it is sent
// from a goroutine on a context that never ends, as RunTx sends a COMMIT (D108): a cancel
// request that reaches a commit waiting for a synchronous standby leaves it committed on the
// primary alone and visible there, so a retry replays the answer and a failover loses it.
// When ctx ends first, sendCommitting returns ErrCommitUnknown wrapping ctx's cause at once;
// the statement goes on, its transaction unseen by every other session, until PostgreSQL
// answers it (D165). On a Bounded q, the room is taken on ctx before the goroutine starts
// (nothing is sent when ctx ends first) and given back when the statement ends, or after
// boundedHold.
func sendCommitting[T any](ctx context.Context, q Querier, send func(ctx context.Context, q Querier) (T, error)) (T, error) {
	if ctx.Done() == nil || !commitsOnItsOwn(q) {
		return send(ctx, q)
	}
	var zero T
	if ctx.Err() != nil {
		return zero, context.Cause(ctx) // nothing was sent
	}
	release := func() {}
	if b, ok := q.(Bounded); ok {
		rq, give, err := b.Reserve(ctx)
		if err != nil {
			return zero, notSent{err}
		}
		q = rq
		var once sync.Once
		held := time.AfterFunc(boundedHold, func() { once.Do(give) })
		release = func() { held.Stop(); once.Do(give) }
	}
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		defer release()
		defer func() {
			if p := recover(); p != nil {
				// The application's pool code (a pgx tracer, a hook, a Querier of its own)
				// panicked on this goroutine of ours, where the panic would end the process; it
				// may have done so after the statement ran: its outcome is unknown (D225).
				done <- result{err: fmt.Errorf("%w: the statement's code panicked: %v", ErrCommitUnknown, p)}
			}
		}()
		v, err := send(context.WithoutCancel(ctx), q)
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.v, r.err
	case <-ctx.Done():
		return zero, fmt.Errorf("%w: the context ended while the answer was being stored; the statement goes on, unseen, until PostgreSQL answers it: %w",
			ErrCommitUnknown, context.Cause(ctx))
	}
}

// Bounded is a Querier that bounds the statements sent through it at once (the middleware's
// lease slots). A statement that sendCommitting sends from a goroutine of its own, on a
// context that never ends, takes its room first, through Reserve on the caller's context:
// waiting for room ends with that context, and the statement, once sent, holds its room until
// PostgreSQL answers it (release), on q, or for boundedHold at most.
type Bounded interface {
	Querier
	Reserve(ctx context.Context) (q Querier, release func(), err error)
}

// boundedHold is how long a statement sent through a Bounded Querier keeps its room while it
// has no answer. A statement of the API waits on a lock at most its function's own
// lock_timeout (2 s), the wait the room bounds (a locked key table); one unanswered a second
// past that is not waiting on a lock but on a connection that stopped answering, and keeping
// its room would hold up the other statements (with one slot, every lease's extension, and
// the read that tells whether its own answer landed) until the kernel gives the connection up.
const boundedHold = 3 * time.Second

// notSent is the error of a statement that was never sent (its context ended while it waited
// for room): safe to retry, and not an outcome unknown.
type notSent struct{ err error }

func (e notSent) Error() string     { return "idem: the statement was not sent: " + e.err.Error() }
func (e notSent) Unwrap() error     { return e.err }
func (e notSent) SafeToRetry() bool { return true }

// commitsOnItsOwn tells whether a statement sent on q is a transaction of its own: q is not a
// transaction, and not a connection inside one.
func commitsOnItsOwn(q Querier) bool {
	switch c := q.(type) {
	case pgx.Tx, *Tx:
		return false
	case *pgx.Conn:
		return c.PgConn().TxStatus() == 'I'
	case interface{ Conn() *pgx.Conn }: // *pgxpool.Conn
		return c.Conn().PgConn().TxStatus() == 'I'
	}
	return true
}

// Release abandons the lease claim with this attempt without a response, so that a retry may
// claim the key again. It returns false when no such claim is in progress. A transactional
// claim is not released (SQLSTATE 55000): roll its transaction back instead.
func Release(ctx context.Context, q Querier, principal, key string, attempt int64) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, releaseSQL, principal, key, attempt).Scan(&ok)
	return ok, classify(err)
}

// Yield ends the lease of the lease claim with this attempt now, without an answer, and keeps
// the key for its request: the next attempt of the same request takes the key over at once,
// in the same generation and with the same provider key (Decision.ProviderKey), so an outside
// provider that deduplicates does not repeat work that may have reached it; another request
// under the key gets Mismatch until the key expires. Use it when the work failed and may or
// may not have had its effect outside (Release, which frees the key for a new generation,
// only when it certainly did not). It returns false when no such lease claim is in progress.
func Yield(ctx context.Context, q Querier, principal, key string, attempt int64) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, yieldSQL, principal, key, attempt).Scan(&ok)
	return ok, classify(err)
}

// SaveFinal stores r as the final answer to c in q's transaction: in the transaction that
// claimed c (after rolling its work back to a savepoint) it finalizes that claim; for a key
// nobody holds it inserts the answer. It returns false when a live row for the key already
// exists (nothing is overwritten). Inside RunTx prefer Tx.FinalOnCommit.
func SaveFinal(ctx context.Context, q Querier, c Claim, r Response) (bool, error) {
	ok, err := sendCommitting(ctx, q, func(ctx context.Context, q Querier) (bool, error) {
		var ok bool
		err := q.QueryRow(ctx, saveFinalSQL, saveFinalArgs(c, r)...).Scan(&ok)
		return ok, err
	})
	return ok, classify(err)
}

// Cleanup deletes expired keys in batches of batchSize (idem_cleanup) until a batch comes
// back short, and returns how many it deleted; a batchSize of zero or less means the SQL
// API's default (Defaults.BatchSize). Pass a pool or a connection outside any transaction,
// so that each batch is its own short transaction. When ctx ends first it returns the count
// so far and ctx.Err(). Safe to run from several processes at once. It runs batch after batch
// without a pause; CleanupPaced spreads them out. On a Citus coordinator it runs passes of
// CleanupWorkers instead: every worker cleans its own shards, in parallel.
func Cleanup(ctx context.Context, q Querier, batchSize int) (int, error) {
	return CleanupPaced(ctx, q, batchSize, 1)
}

// DefaultCleanupDuty is the share of the time a scheduled cleaner's batches take by default
// (the reference server's CLEANUP_DUTY): measured in docs/benchmarks.md ("Cleanup under
// load"), it keeps the keyed p99 within the budget while deleting many times faster than keys
// expire.
const DefaultCleanupDuty = 0.4

// MinCleanupDuty is the smallest duty Pace honours: a pause of at most 99 times the batch.
// A smaller duty (zero and negative ones included) counts as this one, so that no value
// makes a cleaner stop for good or overflow its pause into no pause at all.
const MinCleanupDuty = 0.01

// maxPause bounds one pause whatever a batch took (a batch of hours is a broken database, not
// a reason to stop cleaning for days).
const maxPause = time.Hour

// Pace waits, after a batch of cleanup that took took, so that batches take at most duty of
// the time: the cleaner then uses at most that share of a database connection's time and of
// the CPU and I/O it drives, and the API's latency barely notices it. A duty of 1 or more (or
// NaN) means no wait; one below MinCleanupDuty counts as MinCleanupDuty. It returns early
// with ctx.Err() when ctx ends.
func Pace(ctx context.Context, duty float64, took time.Duration) error {
	if !(duty < 1) || took <= 0 {
		return ctx.Err()
	}
	duty = max(duty, MinCleanupDuty)
	pause := min(float64(took)*(1-duty)/duty, float64(maxPause))
	t := time.NewTimer(time.Duration(pause))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// CleanupPaced is Cleanup with a pause after every batch, so that the batches take at most
// duty of the time (Pace; on a Citus coordinator each worker paces its own batches).
func CleanupPaced(ctx context.Context, q Querier, batchSize int, duty float64) (int, error) {
	if batchSize < 0 || batchSize > MaxCleanupBatch {
		return 0, fmt.Errorf("%w: the cleanup's batch size must be 0 (the SQL default) or from 1 to %d, got %d",
			ErrInvalidArgument, MaxCleanupBatch, batchSize)
	}
	if batchSize == 0 {
		d, err := ReadDefaults(ctx, q)
		if err != nil {
			return 0, err
		}
		batchSize = d.BatchSize
	}
	total := 0
	for {
		n, done, ok, err := CleanupWorkers(ctx, q, batchSize, duty, CleanupWorkersTime)
		total += int(n)
		if err != nil || (ok && done) {
			return total, err
		}
		if !ok {
			break // no workers: batch by batch, here
		}
	}
	for {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		var n int
		began := time.Now()
		if err := q.QueryRow(ctx, cleanupSQL, batchSize).Scan(&n); err != nil {
			if ctx.Err() != nil {
				return total, ctx.Err()
			}
			return total, classifyRead(err)
		}
		total += n
		if n < batchSize {
			return total, nil
		}
		if err := Pace(ctx, duty, time.Since(began)); err != nil {
			return total, err
		}
	}
}

// CleanupWorkersTime is how long one pass of CleanupWorkers lets the workers clean before
// they report (and the caller asks again): long enough that the pass's round of new
// connections to the workers (tens of milliseconds) costs little, short enough that a
// coordinator's transaction, which waits for the pass, stays short.
const CleanupWorkersTime = 10 * time.Second

// CleanupWorkers runs one pass of idem_cleanup_workers: on a Citus coordinator every worker
// deletes the expired keys of its own shards in batches of batchSize (each its own
// transaction there), paced to duty (as Pace: 1 or more, or NaN, no pause; below
// MinCleanupDuty counts as MinCleanupDuty), until it is drained or maxTime has passed, the
// workers in parallel, each through one connection for the whole pass. It returns how many
// keys the pass deleted and whether every node is drained (done); ok is false, and nothing
// is deleted, where the database has no workers to ask (plain PostgreSQL, a Citus worker):
// use Cleanup there. When ctx ends, the pass is cancelled on the workers too.
func CleanupWorkers(ctx context.Context, q Querier, batchSize int, duty float64, maxTime time.Duration) (deleted int64, done, ok bool, err error) {
	var r []int64
	if err := q.QueryRow(ctx, CleanupWorkersSQL, batchSize, WorkerDuty(duty), maxTime).Scan(&r); err != nil {
		if ctx.Err() != nil {
			return 0, false, false, ctx.Err()
		}
		return 0, false, false, classifyRead(err)
	}
	if r == nil {
		return 0, false, false, nil
	}
	return r[0], r[1] == 1, true, nil
}

// WorkerDuty is duty as idem_cleanup_workers takes it (above 0, at most 1), with Pace's
// rules: 1 or more, or NaN, is 1; below MinCleanupDuty (zero and negative ones included) is
// MinCleanupDuty.
func WorkerDuty(duty float64) float64 {
	if !(duty < 1) {
		return 1
	}
	return max(duty, MinCleanupDuty)
}

// Defaults are the SQL API's defaults, which a zero Claim.TTL, Claim.LockTimeout or
// Cleanup batch size stands for. They have one home, the functions (idem.idem_defaults()).
type Defaults struct {
	// TTL is how long a key's answer stays replayable after it was given.
	TTL time.Duration
	// LockTimeout is how long a function waits for a concurrent holder of a key.
	LockTimeout time.Duration
	// BatchSize is idem_cleanup's batch size.
	BatchSize int
}

// ReadDefaults reads the SQL API's defaults from the database.
func ReadDefaults(ctx context.Context, q Querier) (Defaults, error) {
	var ttl, lock int64
	var d Defaults
	if err := q.QueryRow(ctx, defaultsSQL).Scan(&ttl, &lock, &d.BatchSize); err != nil {
		return Defaults{}, classify(err)
	}
	d.TTL = time.Duration(ttl) * time.Microsecond
	d.LockTimeout = time.Duration(lock) * time.Microsecond
	return d, nil
}
