// Package release020 runs release 0.2.0 of pgidem as it was released: the reference server
// (cmd/server) of commit Commit, built from this repository's git history, started as a
// process of its own next to the code under test. The upgrade tests run it against a database
// while this tree's migrate runs, as a rolling upgrade does, and replay what it answered
// through this tree's server.
//
// Nothing here is skipped: a repository without Commit (a shallow clone) or a failed build is
// an error that says so.
package release020

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Commit is release 0.2.0: the commit whose cmd/server is built.
const Commit = "a926d4a64230ea8e94eef72be7886aa9d5eb5a8f"

// Version is what the built server reports (`server version`, the serving log line).
const Version = "0.2.0"

var (
	buildOnce sync.Once
	buildBin  string
	buildErr  error
)

// Binary returns the path of release 0.2.0's server, built once: in os.TempDir(), under a
// directory named by Commit and the Go version, so that every test binary of a run (and the
// runs after it) share one build; test binaries that need it at once wait for one build (a
// file lock). The first call of a process may take a minute (a cold build
// cache); a binary already there is used as it is.
func Binary() (string, error) {
	buildOnce.Do(func() { buildBin, buildErr = build() })
	return buildBin, buildErr
}

func build() (string, error) {
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("pgidem-release020-%s-%s", Commit[:12], runtime.Version()))
	bin := filepath.Join(dir, "server020")
	if fi, err := os.Stat(bin); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
		return bin, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("release020: %w", err)
	}
	// One build at a time across the test binaries of a run (go test runs packages at once):
	// the others wait for it and take its binary.
	lock, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", fmt.Errorf("release020: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", fmt.Errorf("release020: lock %s: %w", lock.Name(), err)
	}
	defer func() { _ = syscall.Flock(int(lock.Fd()), syscall.LOCK_UN) }()
	if fi, err := os.Stat(bin); err == nil && fi.Mode().IsRegular() {
		return bin, nil
	}
	root, err := repoRoot()
	if err != nil {
		return "", err
	}
	if out, err := exec.Command("git", "-C", root, "cat-file", "-e", Commit+"^{commit}").CombinedOutput(); err != nil {
		return "", fmt.Errorf("release020: commit %s (release 0.2.0) is not in the git repository at %s (%v %s): "+
			"the upgrade tests build that release's server from it; fetch the history (git fetch --unshallow, or a full clone)",
			Commit, root, err, strings.TrimSpace(string(out)))
	}
	src, err := os.MkdirTemp(dir, "src-")
	if err != nil {
		return "", fmt.Errorf("release020: %w", err)
	}
	defer os.RemoveAll(src)
	if err := archive(root, src); err != nil {
		return "", err
	}
	// Into a name of its own, then renamed: test binaries building at once never see half a file.
	tmp := filepath.Join(src, "server020")
	cmd := exec.Command("go", "build", "-ldflags", "-X main.Version="+Version, "-o", tmp, "./cmd/server")
	cmd.Dir = src
	// The module as that commit declares it: no workspace of the surroundings, no flags of the
	// test run (-race, -cover).
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("release020: go build ./cmd/server of commit %s: %v\n%s", Commit, err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", fmt.Errorf("release020: %w", err)
	}
	return bin, nil
}

// repoRoot is the top of the git work tree the tests run in.
func repoRoot() (string, error) {
	out, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			err = fmt.Errorf("%v: %s", err, bytes.TrimSpace(ee.Stderr))
		}
		return "", fmt.Errorf("release020: not in a git work tree (%v): the upgrade tests build release 0.2.0's server "+
			"from commit %s of this repository's history", err, Commit)
	}
	return strings.TrimSpace(string(out)), nil
}

// archive writes the tree of Commit into dir: git archive | tar -x.
func archive(root, dir string) error {
	git := exec.Command("git", "-C", root, "archive", "--format=tar", Commit)
	tar := exec.Command("tar", "-x", "-C", dir)
	pipe, err := git.StdoutPipe()
	if err != nil {
		return err
	}
	tar.Stdin = pipe
	var gitErr, tarErr bytes.Buffer
	git.Stderr, tar.Stderr = &gitErr, &tarErr
	if err := git.Start(); err != nil {
		return fmt.Errorf("release020: git archive: %w", err)
	}
	if err := tar.Run(); err != nil {
		_ = git.Wait()
		return fmt.Errorf("release020: tar -x of commit %s: %v %s", Commit, err, tarErr.String())
	}
	if err := git.Wait(); err != nil {
		return fmt.Errorf("release020: git archive %s: %v %s", Commit, err, gitErr.String())
	}
	return nil
}

// Env is the environment of a 0.2.0 server on databaseURL: a free port on loopback, no
// scheduled cleanup, and env on top. The rest of the caller's environment is not passed on
// (a DATABASE_URL or LISTEN_ADDR of the shell never reaches it).
func Env(databaseURL string, env map[string]string) []string {
	vars := map[string]string{"DATABASE_URL": databaseURL, "LISTEN_ADDR": "127.0.0.1:0", "CLEANUP_INTERVAL": "0"}
	for k, v := range env {
		vars[k] = v
	}
	out := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	for k, v := range vars {
		out = append(out, k+"="+v)
	}
	return out
}

// Run runs one command of the 0.2.0 server to its end (migrate, principal create NAME, ...)
// and returns its standard output.
func Run(ctx context.Context, databaseURL string, env map[string]string, args ...string) (string, error) {
	bin, err := Binary()
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = Env(databaseURL, env)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("release020: server %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String(), nil
}

// Migrate runs 0.2.0's `server migrate` on databaseURL.
func Migrate(ctx context.Context, databaseURL string) error {
	_, err := Run(ctx, databaseURL, nil, "migrate")
	return err
}

// Principal runs 0.2.0's `server principal create NAME` and returns the principal's id and
// bearer token.
func Principal(ctx context.Context, databaseURL, name string) (id, token string, err error) {
	out, err := Run(ctx, databaseURL, nil, "principal", "create", name)
	if err != nil {
		return "", "", err
	}
	for _, line := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(line, "principal "); ok {
			id = v
		}
		if v, ok := strings.CutPrefix(line, "token "); ok {
			token = v
		}
	}
	if id == "" || token == "" {
		return "", "", fmt.Errorf("release020: principal create printed %q", out)
	}
	return id, token, nil
}

// Server is 0.2.0's `server serve`, a process of its own.
type Server struct {
	// URL is where it serves: http://127.0.0.1:port.
	URL string

	cmd  *exec.Cmd
	log  *syncBuffer
	done chan error
	once sync.Once
	err  error
}

// Serve starts 0.2.0's `server serve` on databaseURL (env as for Env) and returns once it
// serves. Stop or Kill it.
func Serve(ctx context.Context, databaseURL string, env map[string]string) (*Server, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "serve")
	cmd.Env = Env(databaseURL, env)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("release020: start server serve: %w", err)
	}
	s := &Server{cmd: cmd, log: &syncBuffer{}, done: make(chan error, 1)}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		told := false
		for sc.Scan() {
			line := sc.Bytes()
			s.log.Write(append(append([]byte(nil), line...), '\n'))
			var rec struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if !told && json.Unmarshal(line, &rec) == nil && rec.Msg == "serving" && rec.Addr != "" {
				addr <- rec.Addr
				told = true
			}
		}
		_, _ = io.Copy(s.log, stderr)
		s.done <- cmd.Wait()
	}()
	timer := time.NewTimer(30 * time.Second)
	defer timer.Stop()
	select {
	case a := <-addr:
		s.URL = "http://" + a
		return s, nil
	case err := <-s.done:
		s.once.Do(func() { s.err = err })
		return nil, fmt.Errorf("release020: server serve ended before serving (%v):\n%s", err, s.log.String())
	case <-timer.C:
	case <-ctx.Done():
	}
	_ = s.Kill()
	return nil, fmt.Errorf("release020: server serve did not serve within 30 s:\n%s", s.log.String())
}

// Log is what the server has logged so far (JSON lines).
func (s *Server) Log() string { return s.log.String() }

// Stop sends SIGTERM (a graceful shutdown) and returns what the process exited with.
func (s *Server) Stop() error {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	return s.wait()
}

// Kill ends the process at once (SIGKILL), as a crash does: its lease claims stay in progress
// until their leases run out.
func (s *Server) Kill() error {
	_ = s.cmd.Process.Kill()
	err := s.wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return nil // killed, as asked
	}
	return err
}

func (s *Server) wait() error {
	s.once.Do(func() { s.err = <-s.done })
	return s.err
}

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Fill adds n completed keys of principal p_fill (created here) to 0.2.0's key table, as
// 0.2.0's keyed deposits stored them (its lean table: a token from idem.attempt_seq, the
// action's 64-bit hash, one 8-byte field hash, the answer's status, stored headers and body),
// and vacuums it: the table a migrate then works on. Key fill-g's request_sha256 is
// sha256(g in decimal), so that idem_begin can replay it.
func Fill(ctx context.Context, conn *pgx.Conn, n int) error {
	if _, err := conn.Exec(ctx, `INSERT INTO ledger.principals (id, name) VALUES ('p_fill', 'fill') ON CONFLICT DO NOTHING`); err != nil {
		return fmt.Errorf("release020: fill: %w", err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state,
		principal_id, key, request_sha256, request_fields, response_status, response_headers, response_body, resource_id)
		SELECT now() + interval '1 day', nextval('idem.attempt_seq'), hashtextextended('POST /v1/accounts/{id}/deposits', 0), 'c',
		       'p_fill', 'fill-' || g, sha256(g::text::bytea),
		       convert_to('amount', 'UTF8') || '\x00'::bytea || substr(sha256(g::text::bytea), 1, 8), 201,
		       jsonb_build_object('Content-Type', 'application/json', 'Location', '/v1/accounts/9/deposits/' || g),
		       convert_to('{"id":' || g || ',"account_id":9,"amount":1,"balance":' || g || ',"created_at":"2026-01-01T00:00:00Z"}' || chr(10), 'UTF8'),
		       g::text
		  FROM generate_series(1, $1::integer) AS g`, n); err != nil {
		return fmt.Errorf("release020: fill: %w", err)
	}
	if _, err := conn.Exec(ctx, `VACUUM ANALYZE idem.idempotency_keys`); err != nil {
		return fmt.Errorf("release020: fill: %w", err)
	}
	return nil
}
