// Package pgcluster creates, starts and stops a private PostgreSQL cluster from the local
// initdb and pg_ctl. The test harness uses a throwaway one, `make run` and `make bench` a
// persistent one.
//
// initdb refuses to run as root, so when the process is root every PostgreSQL program runs
// as the operating-system user "postgres" (created by the Debian package) and the cluster's
// directory is handed to that user.
package pgcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Cluster is a PostgreSQL cluster in a directory of its own: Dir/data holds the cluster,
// Dir/postgres.log its log. It listens on a Unix socket in SocketDir and, when TCPAddr is
// set, on that TCP address too. Connections are trusted and made as superuser "postgres".
type Cluster struct {
	// Dir holds the data directory and the log. It is created when missing.
	Dir string
	// SocketDir is the directory of the Unix socket. Default Dir, or no socket at all when
	// TCPAddr is set. Keep it short: a socket path is limited to about 100 bytes.
	SocketDir string
	// Port is the port number (the socket's name, and the TCP port when TCPAddr is set).
	// Default 5432, or a free port when AnyPort is set.
	Port int
	// AnyPort lets Start choose the port of a throwaway cluster when Port is 0: a free one,
	// and another when that one was taken before the server could bind it (up to five
	// tries). Port holds the chosen port once Start returns, and later starts keep it.
	AnyPort bool
	// TCPAddr is the address to listen on, for example "127.0.0.1". Empty: Unix socket only.
	TCPAddr string
	// Settings are passed to the server as -c name=value, for example fsync=off.
	Settings map[string]string

	binDir  string
	started bool
	cred    *syscall.Credential
	uid     int
	gid     int
}

// BinDir finds the directory of initdb and pg_ctl: $PG_BINDIR, then the PATH, then the
// newest /usr/lib/postgresql/N/bin.
func BinDir() (string, error) {
	if d := os.Getenv("PG_BINDIR"); d != "" {
		return d, nil
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		return filepath.Dir(p), nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	if len(dirs) > 0 {
		return filepath.Dir(dirs[0]), nil
	}
	return "", errors.New("pgcluster: initdb not found: install PostgreSQL (Debian: apt-get install postgresql-15) or set PG_BINDIR")
}

func version(initdb string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(initdb))))
	return n
}

func (c *Cluster) prepare() error {
	if c.binDir != "" {
		return nil
	}
	bin, err := BinDir()
	if err != nil {
		return err
	}
	c.binDir = bin
	if c.SocketDir == "" && c.TCPAddr == "" {
		c.SocketDir = c.Dir
	}
	if c.Port == 0 && !c.AnyPort {
		c.Port = 5432
	}
	if c.cred, c.uid, c.gid, err = PostgresUser("the server (initdb refuses root)"); err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	for _, d := range []string{c.Dir, c.SocketDir} {
		if d == "" {
			continue
		}
		// Parents it creates are searchable (the server may run as postgres); the directory
		// itself is private.
		if err := os.MkdirAll(filepath.Dir(d), 0o755); err != nil {
			return fmt.Errorf("pgcluster: %w", err)
		}
		err := os.Mkdir(d, 0o700)
		if err != nil && !os.IsExist(err) {
			return fmt.Errorf("pgcluster: %w", err)
		}
		created := err == nil
		if c.cred == nil {
			// Not root: a directory a run as root handed to postgres (or another user's) is
			// closed to this user, and initdb would fail on it with a bare "permission denied".
			if _, err := os.ReadDir(d); err != nil {
				return fmt.Errorf("pgcluster: cannot use %s: %w; it belongs to %s: run as the user that made it "+
					"(a run as root hands it to postgres), or choose another directory (IDEM_DATA_DIR for the server)", d, err, ownerOf(d))
			}
		}
		if c.cred != nil {
			// Handed to postgres only when it is the cluster's: made now, postgres's already,
			// or root's with nothing but a cluster's files in it. Another user's directory (a
			// .data that user's own runs made), or a directory of other files, is not taken
			// over: the user would be locked out of it (D257).
			if !created && !clusterDir(d, c.uid) {
				return fmt.Errorf("pgcluster: %s belongs to %s, or holds files that are not a private cluster's; as root the "+
					"cluster runs as the user postgres and would take the directory over: run as the user that made it, "+
					"or choose another directory (IDEM_DATA_DIR for the server)", d, ownerOf(d))
			}
			if err := os.Chown(d, c.uid, c.gid); err != nil {
				return fmt.Errorf("pgcluster: %w", err)
			}
			if blocked := unreachable(d, c.uid, c.gid); blocked != "" {
				return fmt.Errorf("pgcluster: the postgres user, which runs the private cluster because initdb refuses root, "+
					"cannot reach %s: %s is closed to it; choose a directory it can reach (IDEM_DATA_DIR for the "+
					"server, for example /var/tmp/idem-data), or open %s with chmod o+x", d, blocked, blocked)
			}
		}
	}
	return nil
}

// clusterDir tells whether root may hand the existing directory d to postgres (uid): it is
// postgres's already, or it is root's and holds a cluster (data/PG_VERSION), or nothing but what
// a private cluster puts there (its data directory, its log, its socket and lock files), or
// nothing at all.
func clusterDir(d string, uid int) bool {
	var st syscall.Stat_t
	if syscall.Stat(d, &st) != nil {
		return false
	}
	if int(st.Uid) == uid {
		return true
	}
	if st.Uid != 0 {
		return false
	}
	if _, err := os.Stat(filepath.Join(d, "data", "PG_VERSION")); err == nil {
		return true // a cluster's directory, whatever else its users keep beside it (server.pid)
	}
	entries, err := os.ReadDir(d)
	if err != nil {
		return false
	}
	for _, e := range entries {
		switch name := e.Name(); {
		case name == "data", name == "postgres.log", name == lockName, strings.HasPrefix(name, ".s.PGSQL."):
		default:
			return false
		}
	}
	return true
}

// ownerOf names the owner of path: "user NAME", or "user id N" when the name is unknown.
func ownerOf(path string) string {
	var st syscall.Stat_t
	if syscall.Stat(path, &st) != nil {
		return "another user"
	}
	id := strconv.Itoa(int(st.Uid))
	if u, err := user.LookupId(id); err == nil {
		return "user " + u.Username
	}
	return "user id " + id
}

// lockName is the file in Dir whose lock Init and Start hold: two processes that find the
// cluster stopped (a server and a command started together) take turns, and the second finds
// it created, or running, instead of failing on the first's postmaster.pid (D257).
const lockName = "pgcluster.lock"

// lock takes the lock of Dir, waiting for it until ctx ends; the returned function releases it.
func (c *Cluster) lock(ctx context.Context) (func(), error) {
	// Read-only (flock needs no more) and readable by all: a run as root makes it in the
	// directory it handed to postgres, and a later run as postgres must open it too.
	f, err := os.OpenFile(filepath.Join(c.Dir, lockName), os.O_CREATE|os.O_RDONLY, 0o644)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: %w", err)
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			f.Close()
			return nil, fmt.Errorf("pgcluster: lock %s: %w", f.Name(), err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("pgcluster: wait for another process that starts the cluster in %s: %w", c.Dir, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// PostgresUser is who a private PostgreSQL program runs as: nobody else (nil, -1, -1) when
// this process is not root; otherwise the operating-system user "postgres" (created by the
// Debian package), because initdb and pgbouncer refuse to run as root. program names what
// needs it, for the error.
func PostgresUser(program string) (cred *syscall.Credential, uid, gid int, err error) {
	if os.Geteuid() != 0 {
		return nil, -1, -1, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, -1, -1, fmt.Errorf("running as root needs the user postgres to run %s: %w", program, err)
	}
	uid, _ = strconv.Atoi(u.Uid)
	gid, _ = strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, uid, gid, nil
}

// unreachable returns the first directory on the way to dir (dir included) that the user
// uid:gid cannot search, or "" when it can reach dir.
func unreachable(dir string, uid, gid int) string {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return ""
	}
	for p := abs; ; p = filepath.Dir(p) {
		var st syscall.Stat_t
		if syscall.Stat(p, &st) == nil {
			mode := st.Mode
			ok := (int(st.Uid) == uid && mode&0o100 != 0) || (int(st.Gid) == gid && mode&0o010 != 0) || mode&0o001 != 0
			if !ok {
				return p
			}
		}
		if p == filepath.Dir(p) {
			return ""
		}
	}
}

func (c *Cluster) dataDir() string { return filepath.Join(c.Dir, "data") }

// LogFile is the server's log.
func (c *Cluster) LogFile() string { return filepath.Join(c.Dir, "postgres.log") }

func (c *Cluster) run(ctx context.Context, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, filepath.Join(c.binDir, name), args...)
	cmd.Dir = c.Dir
	cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8")
	if c.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("pgcluster: %s %s: %w\n%s", name, strings.Join(args, " "), err, out.String())
	}
	return nil
}

// Initialized tells whether Dir already holds a cluster.
func (c *Cluster) Initialized() bool {
	_, err := os.Stat(filepath.Join(c.dataDir(), "PG_VERSION"))
	return err == nil
}

// Init creates the cluster (superuser postgres, trust authentication, UTF-8) unless Dir
// already holds one.
func (c *Cluster) Init(ctx context.Context) error {
	if err := c.prepare(); err != nil {
		return err
	}
	unlock, err := c.lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	if c.Initialized() {
		return nil
	}
	return c.run(ctx, "initdb", "-D", c.dataDir(), "-U", "postgres", "--auth=trust",
		"-E", "UTF8", "--locale=C.UTF-8", "--no-sync")
}

// Start starts the server and waits until it accepts connections. A server that is already
// running in Dir is left running, and Started reports false; Port is then the port it
// listens on (from its postmaster.pid), whatever Port said: a client connects to the
// cluster of Dir, not to whatever listens on the port it was given.
func (c *Cluster) Start(ctx context.Context) error {
	if err := c.prepare(); err != nil {
		return err
	}
	unlock, err := c.lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	c.started = false
	if c.run(ctx, "pg_ctl", "-D", c.dataDir(), "status") == nil {
		if port, ok := c.runningPort(); ok {
			c.Port = port
		}
		return nil
	}
	if !c.AnyPort || c.Port != 0 {
		return c.startOnce(ctx)
	}
	for try := 1; ; try++ {
		port, err := choosePort()
		if err != nil {
			return fmt.Errorf("pgcluster: %w", err)
		}
		c.Port = port
		err = c.startOnce(ctx)
		if err == nil || try == 5 || !errors.Is(err, errPortInUse) {
			return err
		}
		// Taken between the choice and the bind: choose again.
	}
}

// choosePort is FreePort; a test makes it return a taken port.
var choosePort = FreePort

// errPortInUse marks a start that failed because the port was taken.
var errPortInUse = errors.New("port in use")

func (c *Cluster) startOnce(ctx context.Context) error {
	logStart := int64(0)
	if fi, err := os.Stat(c.LogFile()); err == nil {
		logStart = fi.Size() // the log is appended to: read only this start's lines
	}
	c.started = true
	opts := []string{
		"-c", "listen_addresses=" + c.TCPAddr,
		"-c", "unix_socket_directories=" + c.SocketDir,
		"-c", "port=" + strconv.Itoa(c.Port),
	}
	keys := make([]string, 0, len(c.Settings))
	for k := range c.Settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		opts = append(opts, "-c", k+"="+c.Settings[k])
	}
	err := c.run(ctx, "pg_ctl", "-D", c.dataDir(), "-l", c.LogFile(), "-w", "-t", "60",
		"-o", strings.Join(quoteAll(opts), " "), "start")
	if err != nil {
		return c.startError(err, logStart)
	}
	return nil
}

// startError explains a failed start from the server's log: its last FATAL or ERROR lines,
// and for a port in use, which port.
func (c *Cluster) startError(err error, logStart int64) error {
	log, _ := os.ReadFile(c.LogFile())
	if logStart <= int64(len(log)) {
		log = log[logStart:]
	}
	var cause []string
	for _, line := range strings.Split(string(log), "\n") {
		if strings.Contains(line, "FATAL:") || strings.Contains(line, "ERROR:") || strings.Contains(line, "HINT:") {
			cause = append(cause, strings.TrimSpace(line))
		}
	}
	if len(cause) > 4 {
		cause = cause[len(cause)-4:]
	}
	msg := fmt.Sprintf("pgcluster: PostgreSQL did not start in %s", c.Dir)
	inUse := strings.Contains(string(log), "Address already in use") || strings.Contains(string(log), "could not bind")
	if inUse {
		msg += fmt.Sprintf(": port %d is in use by another program (the server's IDEM_DATA_PORT chooses another)", c.Port)
		err = errors.Join(err, errPortInUse)
	}
	if len(cause) > 0 {
		return &startFailure{msg: fmt.Sprintf("%s\n%s\n(log: %s)", msg, strings.Join(cause, "\n"), c.LogFile()), err: err}
	}
	return &startFailure{msg: fmt.Sprintf("%s: %v (log: %s)", msg, err, c.LogFile()), err: err}
}

// startFailure is a failed start: its message explains it from the log, and it wraps pg_ctl's
// error (and errPortInUse when the port was taken).
type startFailure struct {
	msg string
	err error
}

func (e *startFailure) Error() string { return e.msg }
func (e *startFailure) Unwrap() error { return e.err }

func quoteAll(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return out
}

// Started tells whether the last Start started the server (rather than finding it running).
func (c *Cluster) Started() bool { return c.started }

// runningPort is the port of the server running in Dir: the fourth line of its
// postmaster.pid.
func (c *Cluster) runningPort() (int, bool) {
	b, err := os.ReadFile(filepath.Join(c.dataDir(), "postmaster.pid"))
	if err != nil {
		return 0, false
	}
	lines := strings.Split(string(b), "\n")
	if len(lines) < 4 {
		return 0, false
	}
	port, err := strconv.Atoi(strings.TrimSpace(lines[3]))
	if err != nil || port < 1 || port > 65535 {
		return 0, false
	}
	return port, true
}

// Stop stops the server (fast shutdown: open transactions roll back).
func (c *Cluster) Stop(ctx context.Context) error {
	if err := c.prepare(); err != nil {
		return err
	}
	if c.run(ctx, "pg_ctl", "-D", c.dataDir(), "status") != nil {
		return nil
	}
	return c.run(ctx, "pg_ctl", "-D", c.dataDir(), "-m", "fast", "-w", "stop")
}

// Crash stops the server the way a crash would (immediate shutdown: no checkpoint, every
// session cut at once); the next Start recovers from the WAL.
func (c *Cluster) Crash(ctx context.Context) error {
	if err := c.prepare(); err != nil {
		return err
	}
	if c.run(ctx, "pg_ctl", "-D", c.dataDir(), "status") != nil {
		return nil
	}
	return c.run(ctx, "pg_ctl", "-D", c.dataDir(), "-m", "immediate", "-w", "stop")
}

// ConnString is a libpq key/value connection string for database dbname as postgres: over
// the Unix socket when the cluster has one, else over TCP.
func (c *Cluster) ConnString(dbname string) string {
	host, port := c.SocketDir, c.Port
	if host == "" {
		host = c.TCPAddr
	}
	if host == "" {
		host = c.Dir
	}
	if port == 0 {
		port = 5432
	}
	return fmt.Sprintf("host=%s port=%d user=postgres dbname=%s sslmode=disable", host, port, dbname)
}

// TCPHostPort is the cluster's TCP address as host:port, or "" when it listens on none.
func (c *Cluster) TCPHostPort() string {
	if c.TCPAddr == "" {
		return ""
	}
	return net.JoinHostPort(c.TCPAddr, strconv.Itoa(c.Port))
}

// FreePort returns a TCP port on 127.0.0.1 that nothing listened on a moment ago. It is
// chosen at random below the kernel's ephemeral range (ip_local_port_range), where the
// source ports of outgoing connections and other programs' ":0" listeners never land, so
// that the port is still free when its server binds it a while later. Where that range
// cannot be read or leaves no room below it, the kernel chooses.
func FreePort() (int, error) {
	if low := ephemeralLow(); low > freePortFloor+1000 {
		for range 50 {
			port := freePortFloor + rand.IntN(low-freePortFloor)
			ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
			if err == nil {
				ln.Close()
				return port, nil
			}
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// freePortFloor is the lowest port FreePort chooses: above the registered ports most
// services listen on.
const freePortFloor = 20000

// ephemeralLow is the first port of the kernel's ephemeral range, or 0 when unknown.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0
	}
	low, err := strconv.Atoi(f[0])
	if err != nil {
		return 0
	}
	return low
}

// StartTemp initializes and starts a throwaway cluster in a new temporary directory (made
// readable to the postgres user when running as root) with these settings, listening on a
// Unix socket there and on a free TCP port of 127.0.0.1. stop stops it and removes the
// directory.
func StartTemp(ctx context.Context, prefix string, settings map[string]string) (c *Cluster, stop func(), err error) {
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		return nil, nil, err
	}
	if err := os.Chmod(dir, 0o755); err != nil { // the server may run as postgres
		os.RemoveAll(dir)
		return nil, nil, err
	}
	c = &Cluster{Dir: filepath.Join(dir, "pg"), SocketDir: filepath.Join(dir, "pg"), TCPAddr: "127.0.0.1", AnyPort: true, Settings: settings}
	var watchdog *exec.Cmd
	stop = func() {
		if watchdog != nil {
			_ = watchdog.Process.Kill()
			_ = watchdog.Wait()
		}
		_ = c.Stop(context.Background())
		_ = os.RemoveAll(dir)
	}
	if err := c.Init(ctx); err != nil {
		stop()
		return nil, nil, err
	}
	if err := c.Start(ctx); err != nil {
		stop()
		return nil, nil, fmt.Errorf("%w (server log: %s)", err, c.LogFile())
	}
	watchdog = c.watchdog(dir)
	return c, stop, nil
}

// watchdog starts a process of its own session that stops the cluster (immediate shutdown)
// and removes dir once this process is gone without calling stop: a test binary that panics,
// that go test kills at its -timeout, a package whose tests never run pgtest.Main. pg_ctl
// starts the server in a session of its own, so nothing else would stop it. It looks for this
// process every second; nil when it could not be started (the cluster is then left as before).
func (c *Cluster) watchdog(dir string) *exec.Cmd {
	pgctl := shellQuote(filepath.Join(c.binDir, "pg_ctl"))
	if c.cred != nil {
		pgctl = "runuser -u postgres -- " + pgctl
	}
	script := fmt.Sprintf("while [ -d /proc/%d ]; do sleep 1; done; %s -D %s -m immediate stop >/dev/null 2>&1; rm -rf %s",
		os.Getpid(), pgctl, shellQuote(c.dataDir()), shellQuote(dir))
	cmd := exec.Command("sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if cmd.Start() != nil {
		return nil
	}
	return cmd
}

// shellQuote quotes s for sh.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// InitStandby creates the cluster as a streaming standby of primary (which must be running
// and reachable over its Unix socket or TCP): pg_basebackup with -R, so the copy starts in
// recovery and follows the primary. Start it as usual; Promote makes it a primary. Dir must
// not hold a cluster yet.
func (c *Cluster) InitStandby(ctx context.Context, primary *Cluster) error {
	if err := c.prepare(); err != nil {
		return err
	}
	if c.Initialized() {
		return fmt.Errorf("pgcluster: %s already holds a cluster; a standby needs an empty directory", c.Dir)
	}
	host := primary.SocketDir
	if host == "" {
		host = primary.TCPAddr
	}
	return c.run(ctx, "pg_basebackup", "-D", c.dataDir(), "-R", "-X", "stream", "-c", "fast", "--no-sync",
		"-d", fmt.Sprintf("host=%s port=%d user=postgres", host, primary.Port))
}

// Promote ends a standby's recovery and makes it a primary, and waits until it accepts
// writes (pg_ctl promote -w).
func (c *Cluster) Promote(ctx context.Context) error {
	if err := c.prepare(); err != nil {
		return err
	}
	return c.run(ctx, "pg_ctl", "-D", c.dataDir(), "-w", "-t", "60", "promote")
}

// PostmasterPID is the process id of the running server (the first line of postmaster.pid).
func (c *Cluster) PostmasterPID() (int, error) {
	b, err := os.ReadFile(filepath.Join(c.dataDir(), "postmaster.pid"))
	if err != nil {
		return 0, fmt.Errorf("pgcluster: is the server in %s running? %w", c.Dir, err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("pgcluster: postmaster.pid of %s: no process id in %q", c.Dir, line)
	}
	return pid, nil
}

// Kill stops the server the way a dead machine does: every process of it killed with
// SIGKILL (no shutdown of any kind, nothing more sent to a standby). The postmaster is
// stopped first (SIGSTOP), so that it starts no backend while its children are listed and
// killed; then it is killed too. The data directory keeps what was written; a later Start
// recovers it from the WAL.
func (c *Cluster) Kill() error {
	pid, err := c.PostmasterPID()
	if err != nil {
		return err
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return fmt.Errorf("pgcluster: stop the postmaster %d: %w", pid, err)
	}
	for _, child := range childrenOf(pid) {
		_ = syscall.Kill(child, syscall.SIGKILL)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("pgcluster: kill the postmaster %d: %w", pid, err)
	}
	// Wait until the postmaster is gone (the port and the data directory are free).
	for i := 0; i < 500 && syscall.Kill(pid, 0) == nil && !zombie(pid); i++ {
		time.Sleep(10 * time.Millisecond)
	}
	// A dead postmaster that its parent has not reaped yet still answers kill(pid, 0), which is
	// how a starting PostgreSQL tells that its lock files' owner is alive: "lock file already
	// exists" (a history run's promotion fault, under load). It is given a few seconds to be
	// reaped; then its lock files, whose owner is dead, are removed.
	for i := 0; i < 300 && syscall.Kill(pid, 0) == nil; i++ {
		time.Sleep(10 * time.Millisecond)
	}
	if syscall.Kill(pid, 0) == nil && zombie(pid) {
		locks, _ := filepath.Glob(filepath.Join(c.SocketDir, ".s.PGSQL.*.lock"))
		for _, l := range append(locks, filepath.Join(c.dataDir(), "postmaster.pid")) {
			if b, err := os.ReadFile(l); err == nil && strings.SplitN(string(b), "\n", 2)[0] == strconv.Itoa(pid) {
				_ = os.Remove(l) // this postmaster's own, and it is dead
			}
		}
	}
	return nil
}

// zombie tells whether process pid has exited but not been reaped.
func zombie(pid int) bool {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return true
	}
	s := string(stat)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(fields) > 0 && fields[0] == "Z"
}

// childrenOf lists the processes whose parent is pid (from /proc).
func childrenOf(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses; read after the last ")".
		s := string(stat)
		fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(fields) >= 2 {
			if ppid, err := strconv.Atoi(fields[1]); err == nil && ppid == pid {
				out = append(out, child)
			}
		}
	}
	return out
}
