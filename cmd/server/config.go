package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
)

// Config is the server's configuration, read from the environment by ParseFlags. Every
// field names its variable and default; a bad value stops the start with a message that
// names the variable. A zero TTL or LockTimeout means the SQL API's own default.
type Config struct {
	// DatabaseURL (DATABASE_URL): the PostgreSQL to use. Empty: a private cluster under
	// DataDir, created, started and migrated on start.
	DatabaseURL string
	// PoolSize (DATABASE_POOL_SIZE): the most connections this process's requests and cleanup
	// use. Default DefaultPoolSize(): twice the CPUs, at least 4. /healthz and the key gauges
	// have at most 2 more of their own (probeConns), River's receipts 4.
	PoolSize int
	// ListenAddr (LISTEN_ADDR): the HTTP address. Default 127.0.0.1:8080.
	ListenAddr string
	// DataDir (IDEM_DATA_DIR): where the private cluster lives. Default .data.
	DataDir string
	// DataPort (IDEM_DATA_PORT): the private cluster's TCP port on 127.0.0.1. Default 54329.
	DataPort int
	// AppRole (IDEM_APP_ROLE): the role granted the SQL API by migrate. Default idem_app.
	AppRole string
	// TTL (IDEMPOTENCY_TTL): how long a key's answer stays replayable after it was given. 0:
	// the SQL API's default, 24h.
	TTL time.Duration
	// LockTimeout (IDEMPOTENCY_LOCK_TIMEOUT): how long a repeat waits for the first
	// request. 0: the SQL API's default, 2s.
	LockTimeout time.Duration
	// WorkTimeout (IDEMPOTENCY_WORK_TIMEOUT): the server-side deadline of a keyed request's
	// unit of work, which outlives a client that goes away. 0: idem.DefaultWorkTimeout, 30s.
	WorkTimeout time.Duration
	// DuplicateWait (IDEMPOTENCY_DUPLICATE_WAIT): how long a duplicate of a request still
	// running waits for its answer before 409. 0: idem.DefaultDuplicateWait, 10s.
	DuplicateWait time.Duration
	// MaxWaitingClaims (IDEMPOTENCY_MAX_WAITING_CLAIMS): how many requests may wait on a
	// key's row lock at once. 0: a quarter of PoolSize.
	MaxWaitingClaims int
	// MaxWaitingBytes (IDEMPOTENCY_MAX_WAITING_BYTES): what duplicates waiting in this process
	// may hold at once (their bodies plus 4 KiB each). 0: 16 times MaxBodyBytes, at least 16 MiB.
	MaxWaitingBytes int64
	// MaxBodyBytes (MAX_BODY_BYTES): the largest request body. Default 1048576.
	MaxBodyBytes int64
	// MaxStoredBytes (MAX_STORED_RESPONSE_BYTES): the largest response body stored for
	// replay, 1 to 1073741824. Default 262144.
	MaxStoredBytes int
	// CleanupInterval (CLEANUP_INTERVAL): how often expired keys are deleted; 0 disables.
	// Default 1m.
	CleanupInterval time.Duration
	// CleanupBatchSize (CLEANUP_BATCH_SIZE): rows per cleanup batch. Zero (the default) means
	// the SQL API's default (idem.idem_defaults(), 1000).
	CleanupBatchSize int
	// CleanupDuty (CLEANUP_DUTY): the share of the time the scheduled cleaner's batches may
	// take: after each batch it pauses so long that its batches take at most this share of a
	// pass (1: no pause). Default 0.4 (idem.DefaultCleanupDuty). `server cleanup` runs without pauses.
	CleanupDuty float64
	// CleanupVacuum (CLEANUP_VACUUM): whether cleanup vacuums the key table once its passes
	// have deleted more rows than autovacuum's threshold for the table (when the server's role
	// owns it). Default true.
	CleanupVacuum bool
	// ShutdownTimeout (SHUTDOWN_TIMEOUT): how long in-flight requests may finish. Default 10s.
	ShutdownTimeout time.Duration
	// PayoutsLease (PAYOUTS_LEASE): the lease of POST /v1/payouts, a lease route; the
	// heartbeat extends it every third of it while a payout runs. Default 5s.
	PayoutsLease time.Duration
	// PayoutProviderDelay (PAYOUT_PROVIDER_DELAY): how long the simulated payment provider
	// takes to answer a new payout. Default 200ms.
	PayoutProviderDelay time.Duration
	// ReceiptURL (RECEIPT_URL): where the receipt of every transfer is POSTed, by a River job
	// that the transfer enqueues in its own transaction (a webhook; the receiver deduplicates
	// by the Idempotency-Key header). Empty (the default): no receipts, and no River client.
	ReceiptURL string
	// ReceiptLease (RECEIPT_LEASE): the lease of a receipt's sending: a worker that dies
	// keeps the receipt's key that long before River's retry takes it over. Default 10s.
	ReceiptLease time.Duration
	// ReceiptTimeout (RECEIPT_TIMEOUT): River's job timeout for a receipt's sending. Default 30s.
	ReceiptTimeout time.Duration
	// ReceiptRescueAfter (RECEIPT_RESCUE_AFTER): how long a receipt job may stay running
	// before River's rescuer makes it retryable (its worker died). Default 1h; more than
	// RECEIPT_TIMEOUT.
	ReceiptRescueAfter time.Duration
	// PayoutStepPause (PAYOUT_STEP_PAUSE): how long POST /v1/stepped-payouts waits after
	// each of its steps, so that a fault test can kill the server between two steps. Default
	// 0: no pause.
	PayoutStepPause time.Duration
	// TransfersRequireKey (TRANSFERS_REQUIRE_KEY): whether POST /v1/transfers needs an
	// Idempotency-Key. Default true; false only to benchmark the route without keys.
	TransfersRequireKey bool
	// LogLevel (LOG_LEVEL): debug, info, warn or error. Default info.
	LogLevel slog.Level
}

// DefaultPoolSize is DATABASE_POOL_SIZE's default: twice the CPUs this process may use, at
// least 4. Under contention more connections than that only add lock waits and context
// switches (docs/operations.md, "Sizing the pool", has the measurements).
func DefaultPoolSize() int { return max(4, 2*runtime.GOMAXPROCS(0)) }

// defaultConfig is every default, in one place.
func defaultConfig() Config {
	return Config{
		PoolSize: DefaultPoolSize(), ListenAddr: "127.0.0.1:8080", DataDir: ".data", DataPort: 54329,
		AppRole: idemmigrate.DefaultAppRole, MaxBodyBytes: 1 << 20, MaxStoredBytes: 256 << 10,
		CleanupInterval: time.Minute, CleanupDuty: idem.DefaultCleanupDuty, CleanupVacuum: true, ShutdownTimeout: 10 * time.Second,
		PayoutsLease: 5 * time.Second, PayoutProviderDelay: 200 * time.Millisecond,
		ReceiptLease: 10 * time.Second, ReceiptTimeout: 30 * time.Second, ReceiptRescueAfter: time.Hour,
		TransfersRequireKey: true, LogLevel: slog.LevelInfo,
	}
}

// usage is the help text: the commands and every environment variable.
const usage = `usage: server [command]

commands:
  serve                    serve HTTP on LISTEN_ADDR (the default)
  migrate                  install or upgrade the idem SQL API and the ledger, then exit
  cleanup                  delete expired idempotency keys (one full pass), then exit
  principal create NAME    create a principal; prints its id and a bearer token once
  keys [by-principal]      print the summary of the idempotency keys (idem_summary): by state, backlog, oldest claim
  keys stuck [AGE]         list the lease claims in progress claimed at least AGE ago (idem_stuck; the operator role only)
  keys PRINCIPAL KEY       print one key's story (idem_key): state, times, token, stored status; never its body
  keys release PRINCIPAL KEY TOKEN [REASON]
                           release a stuck lease claim (idem_release_stuck; the operator role only)
  version                  print the version
  help                     print this text (also -h, --help)

environment (docs/operations.md):
  DATABASE_URL                    PostgreSQL connection string (connect_timeout: 5 s unless given); unset: a private cluster under IDEM_DATA_DIR
  DATABASE_POOL_SIZE              most connections requests and cleanup use (twice the CPUs, at least 4; +2 for /healthz)
  LISTEN_ADDR                     HTTP address, host:port (127.0.0.1:8080)
  IDEM_DATA_DIR                   the private cluster's directory (.data)
  IDEM_DATA_PORT                  the private cluster's port on 127.0.0.1 (54329)
  IDEM_APP_ROLE                   the role migrate grants the API to (idem_app)
  IDEMPOTENCY_TTL                 how long an answer stays replayable after it was given (the SQL default, 24h)
  IDEMPOTENCY_LOCK_TIMEOUT        how long a repeat waits for the first request (the SQL default, 2s)
  IDEMPOTENCY_WORK_TIMEOUT        the deadline of a keyed request's work, which outlives its client (30s)
  IDEMPOTENCY_DUPLICATE_WAIT      how long a duplicate waits for the first's answer before 409 (10s)
  IDEMPOTENCY_MAX_WAITING_CLAIMS  requests that may wait on a key's row lock at once (a quarter of the pool)
  IDEMPOTENCY_MAX_WAITING_BYTES   what duplicates waiting for a request of this process may hold (16 x MAX_BODY_BYTES, at least 16 MiB)
  MAX_BODY_BYTES                  the largest request body (1048576)
  MAX_STORED_RESPONSE_BYTES       the largest response body stored for replay, from 1 (262144)
  CLEANUP_INTERVAL                how often expired keys are deleted, 1s to 86400h; 0 disables (1m)
  CLEANUP_BATCH_SIZE              rows per cleanup batch, 1 to 1000000 (the SQL default, 1000)
  CLEANUP_DUTY                    the share of the time the scheduled cleaner's batches may take, 0.01 to 1 (0.4)
  CLEANUP_VACUUM                  vacuum the key table once cleanup deleted more than autovacuum's threshold, when the role owns it (true)
  SHUTDOWN_TIMEOUT                how long in-flight requests may finish (10s)
  PAYOUTS_LEASE                   the lease of POST /v1/payouts, extended while a payout runs (5s)
  PAYOUT_PROVIDER_DELAY           how long the simulated payment provider takes to answer (200ms)
  RECEIPT_URL                     where a River job POSTs the receipt of every transfer (unset: no receipts)
  RECEIPT_LEASE                   the lease of a receipt's sending, extended while it runs (10s)
  RECEIPT_TIMEOUT                 River's job timeout for a receipt's sending (30s)
  RECEIPT_RESCUE_AFTER            how long a receipt job may run before River's rescuer retries it (1h)
  PAYOUT_STEP_PAUSE               a pause after each step of POST /v1/stepped-payouts, for fault tests (0)
  TRANSFERS_REQUIRE_KEY           whether POST /v1/transfers needs a key; false only for benchmarks (true)
  LOG_LEVEL                       debug, info, warn or error, any case (info)`

var roleName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// ParseFlags reads the command from args and the configuration from getenv.
func (m *Main) ParseFlags(args []string, getenv func(string) string) error {
	m.Command = "serve"
	if len(args) > 0 {
		m.Command, m.Args = args[0], args[1:]
	}
	// -h, -help and --help right after a command (or after `principal create`) ask for the
	// help too: `server principal create --help` must not create a principal named --help.
	// Elsewhere they are values: `server keys alice -h` looks up the key "-h".
	isHelp := func(a string) bool { return a == "-h" || a == "-help" || a == "--help" }
	if (len(m.Args) > 0 && isHelp(m.Args[0])) ||
		(m.Command == "principal" && len(m.Args) > 1 && m.Args[0] == "create" && isHelp(m.Args[1])) {
		m.Command, m.Args = "help", nil
	}
	switch m.Command {
	case "help", "-h", "-help", "--help":
		m.Command = "help"
		return nil
	case "serve", "migrate", "cleanup", "version":
		if len(m.Args) > 0 {
			return fmt.Errorf("%s takes no arguments\n\n%s", m.Command, usage)
		}
	case "keys":
		n := len(m.Args)
		stuck := n >= 1 && m.Args[0] == "stuck"
		if (stuck && n > 2) || (!stuck && (n == 3 || (n == 1 && m.Args[0] != "by-principal") || (n >= 4 && m.Args[0] != "release"))) ||
			(n == 2 && m.Args[0] == "by-principal") {
			return fmt.Errorf("keys: want `keys`, `keys by-principal`, `keys stuck [AGE]`, `keys PRINCIPAL KEY` or `keys release PRINCIPAL KEY TOKEN [REASON]`\n\n%s", usage)
		}
		// AGE and TOKEN are read here, before any database work, as every other argument.
		if stuck && n == 2 {
			if _, err := stuckAge(m.Args[1]); err != nil {
				return fmt.Errorf("%w\n\n%s", err, usage)
			}
		}
		if n >= 4 {
			if _, err := releaseToken(m.Args[3]); err != nil {
				return fmt.Errorf("%w\n\n%s", err, usage)
			}
		}
	case "principal":
		if len(m.Args) != 2 || m.Args[0] != "create" {
			return fmt.Errorf("principal: want principal create NAME\n\n%s", usage)
		}
		if !validName(m.Args[1]) {
			return errors.New("principal create: NAME must be 1 to 100 characters of valid UTF-8, none of them a control character")
		}
		if strings.HasPrefix(m.Args[1], "-") {
			return fmt.Errorf("principal create: NAME must not start with -, which marks an option (got %q)", m.Args[1])
		}
	default:
		return fmt.Errorf("unknown command %q\n\n%s", m.Command, usage)
	}
	c := defaultConfig()
	// Blank is unset, as for every other variable: the private cluster under IDEM_DATA_DIR.
	c.DatabaseURL = strings.TrimSpace(getenv("DATABASE_URL"))
	p := envParser{getenv: getenv}
	if v := strings.TrimSpace(getenv("LISTEN_ADDR")); v != "" {
		// The port is checked here with the rest (a number from 0 to 65535, or a service
		// name the system knows), not first by net.Listen after the database was opened.
		if _, port, err := net.SplitHostPort(v); err != nil {
			p.fail("LISTEN_ADDR", v, "want host:port, for example 127.0.0.1:8080")
		} else if port == "" {
			// net.LookupPort takes "" for 0: the server would listen on a port nobody knows
			// (LISTEN_ADDR=0.0.0.0:$PORT with PORT unset). 0 written out still asks for one.
			p.fail("LISTEN_ADDR", v, "want a port after the colon, for example 127.0.0.1:8080 (0 for any free port)")
		} else if _, err := net.LookupPort("tcp", port); err != nil {
			p.fail("LISTEN_ADDR", v, "want a port from 0 to 65535, for example 127.0.0.1:8080")
		}
		c.ListenAddr = v
	}
	p.integer("DATABASE_POOL_SIZE", &c.PoolSize, 2, 10_000)
	p.str("IDEM_DATA_DIR", &c.DataDir)
	p.integer("IDEM_DATA_PORT", &c.DataPort, 1, 65535)
	if v := strings.TrimSpace(getenv("IDEM_APP_ROLE")); v != "" {
		switch {
		case !roleName.MatchString(v):
			p.fail("IDEM_APP_ROLE", v, "want a lower-case SQL identifier")
		case strings.HasPrefix(v, "pg_") || v == "public" || v == "none" || v == "current_user" || v == "session_user" || v == "current_role":
			// PostgreSQL's reserved names, and its predefined roles (pg_read_all_data, pg_monitor:
			// granting them the API would give every backup or monitoring login its writes).
			p.fail("IDEM_APP_ROLE", v, "want a role of the application's own: names that begin with pg_, and public, are PostgreSQL's")
		}
		c.AppRole = v
	}
	p.duration("IDEMPOTENCY_TTL", &c.TTL, time.Second)
	p.durationUpTo("IDEMPOTENCY_LOCK_TIMEOUT", &c.LockTimeout, time.Millisecond, maxLockTimeout, "PostgreSQL's largest lock_timeout")
	p.duration("IDEMPOTENCY_WORK_TIMEOUT", &c.WorkTimeout, time.Millisecond)
	p.durationUpTo("IDEMPOTENCY_DUPLICATE_WAIT", &c.DuplicateWait, time.Millisecond, idem.MaxDuplicateWait, "the library's longest wait")
	p.integer("IDEMPOTENCY_MAX_WAITING_CLAIMS", &c.MaxWaitingClaims, 1, 10_000)
	maxBody := int(c.MaxBodyBytes)
	p.integer("MAX_BODY_BYTES", &maxBody, 1, 1<<30)
	c.MaxBodyBytes = int64(maxBody)
	maxWaiting := int(c.MaxWaitingBytes)
	p.integer("IDEMPOTENCY_MAX_WAITING_BYTES", &maxWaiting, 1, 1<<40)
	c.MaxWaitingBytes = int64(maxWaiting)
	if c.MaxWaitingBytes != 0 && c.MaxWaitingBytes < c.MaxBodyBytes+4096 {
		// Below one duplicate with the largest body, no duplicate with a body could ever wait.
		p.fail("IDEMPOTENCY_MAX_WAITING_BYTES", strconv.FormatInt(c.MaxWaitingBytes, 10),
			fmt.Sprintf("want at least MAX_BODY_BYTES + 4096 (%d): room for one duplicate with the largest body", c.MaxBodyBytes+4096))
	}
	p.integer("MAX_STORED_RESPONSE_BYTES", &c.MaxStoredBytes, 1, 1<<30)
	p.durationOrOff("CLEANUP_INTERVAL", &c.CleanupInterval, time.Second, "disable the in-process cleanup")
	p.integer("CLEANUP_BATCH_SIZE", &c.CleanupBatchSize, 1, 1_000_000)
	if v := strings.TrimSpace(getenv("CLEANUP_DUTY")); v != "" {
		d, err := strconv.ParseFloat(v, 64)
		if err != nil || !(d >= idem.MinCleanupDuty && d <= 1) {
			p.fail("CLEANUP_DUTY", v, "want a share of the time from 0.01 to 1, such as 0.4")
		} else {
			c.CleanupDuty = d
		}
	}
	p.duration("SHUTDOWN_TIMEOUT", &c.ShutdownTimeout, time.Millisecond)
	p.boolean("CLEANUP_VACUUM", &c.CleanupVacuum)
	p.duration("PAYOUTS_LEASE", &c.PayoutsLease, time.Second)
	p.durationOrOff("PAYOUT_PROVIDER_DELAY", &c.PayoutProviderDelay, time.Millisecond, "answer at once")
	if v := strings.TrimSpace(getenv("RECEIPT_URL")); v != "" {
		if u, err := url.Parse(v); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			p.fail("RECEIPT_URL", v, "want an http or https URL, such as http://127.0.0.1:9000/receipts")
		}
		c.ReceiptURL = v
	}
	p.duration("RECEIPT_LEASE", &c.ReceiptLease, time.Second)
	p.duration("RECEIPT_TIMEOUT", &c.ReceiptTimeout, time.Millisecond)
	p.duration("RECEIPT_RESCUE_AFTER", &c.ReceiptRescueAfter, time.Millisecond)
	if c.ReceiptRescueAfter <= c.ReceiptTimeout {
		p.fail("RECEIPT_RESCUE_AFTER", c.ReceiptRescueAfter.String(), fmt.Sprintf("want more than RECEIPT_TIMEOUT (%s): River rescues only a job past its timeout", c.ReceiptTimeout))
	}
	p.durationOrOff("PAYOUT_STEP_PAUSE", &c.PayoutStepPause, time.Millisecond, "pause not at all")
	p.boolean("TRANSFERS_REQUIRE_KEY", &c.TransfersRequireKey)
	if v := strings.TrimSpace(getenv("LOG_LEVEL")); v != "" {
		switch strings.ToLower(v) {
		case "debug", "info", "warn", "error":
			_ = c.LogLevel.UnmarshalText([]byte(v))
		default: // slog would also take "info+2" and "warning"; the docs name these four
			p.fail("LOG_LEVEL", v, "want debug, info, warn or error")
		}
	}
	if c.DatabaseURL != "" {
		if pc, err := pgx.ParseConfig(c.DatabaseURL); err != nil {
			p.errs = append(p.errs, fmt.Errorf("DATABASE_URL: %v", err))
		} else if _, ok := pc.RuntimeParams["pool_max_conns"]; ok {
			// pgxpool reads it, but the pool's size is DATABASE_POOL_SIZE's (the waiting claims'
			// bound is set against it): one setting, not two that disagree in silence.
			p.errs = append(p.errs, errors.New("DATABASE_URL: pool_max_conns is not read here; set DATABASE_POOL_SIZE instead"))
		}
	}
	if c.MaxWaitingClaims >= c.PoolSize {
		if getenv("DATABASE_POOL_SIZE") == "" {
			p.errs = append(p.errs, fmt.Errorf("IDEMPOTENCY_MAX_WAITING_CLAIMS (%d) must be smaller than the pool: %d, DATABASE_POOL_SIZE's default on this machine (twice the CPUs, at least 4); set DATABASE_POOL_SIZE above %[1]d or lower IDEMPOTENCY_MAX_WAITING_CLAIMS",
				c.MaxWaitingClaims, c.PoolSize))
		} else {
			p.errs = append(p.errs, fmt.Errorf("IDEMPOTENCY_MAX_WAITING_CLAIMS (%d) must be smaller than DATABASE_POOL_SIZE (%d)", c.MaxWaitingClaims, c.PoolSize))
		}
	}
	if err := errors.Join(p.errs...); err != nil {
		return err
	}
	m.Config = c
	m.log = slog.New(slog.NewJSONHandler(m.stderr, &slog.HandlerOptions{Level: c.LogLevel}))
	if m.Addr == nil {
		m.Addr = make(chan string, 1)
	}
	return nil
}

// envParser reads environment variables and collects every bad value.
type envParser struct {
	getenv func(string) string
	errs   []error
}

func (p *envParser) fail(name, value, want string) {
	p.errs = append(p.errs, fmt.Errorf("%s=%q: %s", name, value, want))
}

func (p *envParser) str(name string, dst *string) {
	if v := strings.TrimSpace(p.getenv(name)); v != "" {
		*dst = v
	}
}

func (p *envParser) integer(name string, dst *int, lo, hi int) {
	v := strings.TrimSpace(p.getenv(name))
	if v == "" {
		return
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		p.fail(name, v, fmt.Sprintf("want an integer from %d to %d", lo, hi))
		return
	}
	*dst = n
}

func (p *envParser) boolean(name string, dst *bool) {
	v := strings.TrimSpace(p.getenv(name))
	if v == "" {
		return
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		p.fail(name, v, "want true or false")
		return
	}
	*dst = b
}

func (p *envParser) duration(name string, dst *time.Duration, min time.Duration) {
	p.durationUpTo(name, dst, min, maxDuration, "the SQL API's 10 years")
}

// durationUpTo is duration for a setting with a bound of its own, max, which what names.
func (p *envParser) durationUpTo(name string, dst *time.Duration, min, max time.Duration, what string) {
	v := strings.TrimSpace(p.getenv(name))
	if v == "" {
		return
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < min || d > max {
		p.fail(name, v, fmt.Sprintf("want a duration from %s to %s (%s), such as 30s or 5m", min, max, what))
		return
	}
	*dst = d
}

// durationOrOff is duration for a setting whose zero turns something off: 0, written as 0 or as
// a duration (0s, 0ms), is taken as it is; any other value from min.
func (p *envParser) durationOrOff(name string, dst *time.Duration, min time.Duration, off string) {
	v := strings.TrimSpace(p.getenv(name))
	if v == "" {
		return
	}
	d, err := time.ParseDuration(v)
	if err != nil || (d != 0 && (d < min || d > maxDuration)) {
		p.fail(name, v, fmt.Sprintf("want 0 to %s, or a duration from %s to %s (the SQL API's 10 years), such as 30s or 5m", off, min, maxDuration))
		return
	}
	*dst = d
}

// maxDuration bounds every duration setting: the SQL API refuses a TTL or a lease over
// interval '10 years', which PostgreSQL counts as 120 months of 30 days; longer is a unit
// mistake.
const maxDuration = idem.MaxDuration

// maxLockTimeout is PostgreSQL's largest lock_timeout (INT_MAX milliseconds, about 24 days).
const maxLockTimeout = idem.MaxLockTimeout
