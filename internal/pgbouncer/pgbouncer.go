// Package pgbouncer starts a private PgBouncer (Debian's /usr/sbin/pgbouncer) in front of a
// PostgreSQL server, in transaction pool mode, the way internal/pgcluster starts PostgreSQL:
// its own pgbouncer.ini and userlist.txt in a temporary directory, a free TCP port on
// 127.0.0.1 (never the system service's 6432, and no Unix socket), started and waited for,
// stopped and removed at the end.
//
// PgBouncer refuses to run as root, so when the process is root it runs as the operating-
// system user "postgres" (created by the Debian PostgreSQL package), which owns the directory.
package pgbouncer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

// Config says where PgBouncer sends its clients and how it pools them.
type Config struct {
	// Host is the PostgreSQL server's address: a host name or IP address, or the directory
	// of its Unix socket.
	Host string
	// Port is the PostgreSQL server's port.
	Port int
	// Users are the roles clients may log in as, with their passwords ("" when the server
	// trusts them). PgBouncer lets in only the users of its auth file, and logs in to the
	// server with these passwords. Default: postgres with no password.
	Users map[string]string
	// Settings override or add [pgbouncer] settings of DefaultSettings (for example
	// default_pool_size). An empty value removes a setting.
	Settings map[string]string
}

// DefaultSettings are the [pgbouncer] settings of every PgBouncer this package starts, besides
// the addresses and files (listen_addr, listen_port, unix_socket_dir, auth_file, logfile,
// pidfile), with why each is there. Config.Settings overrides them.
var DefaultSettings = []Setting{
	{"pool_mode", "transaction", "a server connection belongs to a client for one transaction only: what the idem SQL API is built for (no session state, no named prepared statements)"},
	{"default_pool_size", "20", "server connections per database and user: room for several servers' pools (a cleanup pass needs one, only while a batch runs)"},
	{"max_client_conn", "500", "client connections PgBouncer accepts in all: every process's whole pool (DATABASE_POOL_SIZE each) and the tests' own connections"},
	{"max_db_connections", "0", "no cap per database beyond default_pool_size"},
	{"auth_type", "trust", "the test clusters trust every local connection; the user must still be listed in auth_file"},
	{"ignore_startup_parameters", "extra_float_digits", "some drivers (JDBC, for one) send it in the startup packet, and PgBouncer 1.18 refuses a startup parameter it does not know unless told to ignore it (pgx v5 sends none beyond user, database and what the connection string adds)"},
	{"server_login_retry", "1", "retry a failed server login after 1 second, not 15: a test database may be created a moment after PgBouncer starts"},
	{"query_wait_timeout", "30", "a client that waits longer than this for a server connection gets an error instead of hanging (default 120 s)"},
	{"admin_users", "postgres", "the tests read SHOW SERVERS and SHOW CONFIG on the admin console (database pgbouncer)"},
}

// Setting is one line of the [pgbouncer] section and why it is there.
type Setting struct{ Name, Value, Why string }

// Bouncer is a running PgBouncer.
type Bouncer struct {
	// Dir holds pgbouncer.ini, userlist.txt, pgbouncer.log and pgbouncer.pid.
	Dir string
	// Port is the TCP port it listens on, on 127.0.0.1.
	Port int

	cmd  *exec.Cmd
	done chan struct{}
	err  error // what Wait returned, once done is closed
}

// Binary finds pgbouncer: on the PATH, else /usr/sbin/pgbouncer (Debian puts it there, and
// /usr/sbin is not on every user's PATH).
func Binary() (string, error) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	if st, err := os.Stat("/usr/sbin/pgbouncer"); err == nil && !st.IsDir() {
		return "/usr/sbin/pgbouncer", nil
	}
	return "", errors.New("pgbouncer: the pgbouncer program was not found on the PATH nor at /usr/sbin/pgbouncer: " +
		"install it (Debian: apt-get install pgbouncer)")
}

// HostPort is PgBouncer's address, 127.0.0.1:Port.
func (b *Bouncer) HostPort() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(b.Port)) }

// LogFile is PgBouncer's log.
func (b *Bouncer) LogFile() string { return filepath.Join(b.Dir, "pgbouncer.log") }

// Log returns the end of PgBouncer's log (at most 4 KiB), for error messages.
func (b *Bouncer) Log() string {
	data, _ := os.ReadFile(b.LogFile())
	if len(data) > 4096 {
		data = data[len(data)-4096:]
	}
	return string(data)
}

// Start writes the configuration into a new temporary directory, starts PgBouncer on a free
// port of 127.0.0.1 and waits until it accepts connections. Stop stops it and removes the
// directory; call it also when the caller fails.
func Start(ctx context.Context, cfg Config) (*Bouncer, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	if cfg.Host == "" || cfg.Port == 0 {
		return nil, errors.New("pgbouncer: Config needs the server's Host and Port")
	}
	cred, uid, gid, err := pgcluster.PostgresUser("pgbouncer (it refuses root)")
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: %w", err)
	}
	// The port is free a moment before PgBouncer binds it; another process may take it in
	// between, so a start that fails to bind is tried again on another port.
	var lastErr error
	for range 3 {
		b, err := start(ctx, bin, cfg, cred, uid, gid)
		if err == nil {
			return b, nil
		}
		lastErr = err
		if !errors.Is(err, errAddrInUse) {
			break
		}
	}
	return nil, lastErr
}

var errAddrInUse = errors.New("pgbouncer: the port was taken")

func start(ctx context.Context, bin string, cfg Config, cred *syscall.Credential, uid, gid int) (*Bouncer, error) {
	dir, err := os.MkdirTemp("", "idem-pgbouncer-")
	if err != nil {
		return nil, err
	}
	port, err := pgcluster.FreePort()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	b := &Bouncer{Dir: dir, Port: port, done: make(chan struct{})}
	ini := filepath.Join(dir, "pgbouncer.ini")
	files := map[string]string{ini: b.ini(cfg), filepath.Join(dir, "userlist.txt"): userlist(cfg.Users)}
	for path, text := range files {
		if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	if cred != nil { // pgbouncer runs as postgres: it reads the files and writes its log here
		for _, p := range []string{dir, ini, filepath.Join(dir, "userlist.txt")} {
			if err := os.Chown(p, uid, gid); err != nil {
				os.RemoveAll(dir)
				return nil, fmt.Errorf("pgbouncer: %w", err)
			}
		}
	}
	cmd := exec.Command(bin, ini) // in the foreground: Stop signals this very process
	cmd.Dir = dir
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	}
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("pgbouncer: start %s: %w", bin, err)
	}
	b.cmd = cmd
	go func() {
		b.err = cmd.Wait()
		close(b.done)
	}()
	deadline := time.Now().Add(15 * time.Second)
	for {
		select {
		case <-b.done:
			log := out.String() + b.Log()
			os.RemoveAll(dir)
			if strings.Contains(log, "Address already in use") {
				return nil, errAddrInUse
			}
			return nil, fmt.Errorf("pgbouncer: exited at start (%v):\n%s", b.err, log)
		default:
		}
		if c, err := net.DialTimeout("tcp", b.HostPort(), time.Second); err == nil {
			c.Close()
			return b, nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			log := b.Log()
			b.Stop()
			return nil, fmt.Errorf("pgbouncer: not accepting connections on %s after 15 s (%v):\n%s", b.HostPort(), ctx.Err(), log)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Stop shuts PgBouncer down at once (SIGTERM, then SIGKILL after 10 seconds), closing every
// client and server connection, and removes its directory. Safe to call more than once.
func (b *Bouncer) Stop() {
	if b.cmd != nil && b.cmd.Process != nil {
		select {
		case <-b.done:
		default:
			_ = b.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-b.done:
			case <-time.After(10 * time.Second):
				_ = b.cmd.Process.Kill()
				<-b.done
			}
		}
	}
	_ = os.RemoveAll(b.Dir)
}

// settings returns the [pgbouncer] settings of cfg: DefaultSettings with cfg.Settings on top,
// sorted by name (without the addresses and files).
func (cfg Config) settings() map[string]string {
	s := map[string]string{}
	for _, d := range DefaultSettings {
		s[d.Name] = d.Value
	}
	for k, v := range cfg.Settings {
		s[k] = v
	}
	return s
}

// ini is pgbouncer.ini: every database name goes to the one server (the wildcard), and each
// setting comes with its reason.
func (b *Bouncer) ini(cfg Config) string {
	var w strings.Builder
	fmt.Fprintf(&w, "; written by internal/pgbouncer\n[databases]\n")
	fmt.Fprintf(&w, "; every database a client names goes to the same server, under that name\n")
	fmt.Fprintf(&w, "* = host=%s port=%d\n\n[pgbouncer]\n", cfg.Host, cfg.Port)
	fmt.Fprintf(&w, "; a port of our own on the loopback, never the system service's 6432, and no Unix socket\n")
	fmt.Fprintf(&w, "listen_addr = 127.0.0.1\nlisten_port = %d\nunix_socket_dir =\n", b.Port)
	fmt.Fprintf(&w, "auth_file = %s\nlogfile = %s\npidfile = %s\n",
		filepath.Join(b.Dir, "userlist.txt"), b.LogFile(), filepath.Join(b.Dir, "pgbouncer.pid"))
	why := map[string]string{}
	for _, d := range DefaultSettings {
		why[d.Name] = d.Why
	}
	settings := cfg.settings()
	for _, k := range slices.Sorted(maps.Keys(settings)) {
		v, ok := settings[k]
		if !ok || v == "" {
			continue
		}
		if r, ok := why[k]; ok {
			fmt.Fprintf(&w, "; %s\n", r)
		}
		fmt.Fprintf(&w, "%s = %s\n", k, v)
	}
	return w.String()
}

// userlist is userlist.txt: "name" "password" per line.
func userlist(users map[string]string) string {
	if len(users) == 0 {
		users = map[string]string{"postgres": ""}
	}
	var w strings.Builder
	quote := func(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
	for _, n := range slices.Sorted(maps.Keys(users)) {
		fmt.Fprintf(&w, "%s %s\n", quote(n), quote(users[n]))
	}
	return w.String()
}
