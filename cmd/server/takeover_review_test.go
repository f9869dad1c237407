package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

type toServe struct {
	cmd    *exec.Cmd
	exited chan struct{}
	out    *toBuf
	addr   string
}

type toBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *toBuf) Write(p []byte) (int, error) { b.mu.Lock(); defer b.mu.Unlock(); return b.b.Write(p) }
func (b *toBuf) String() string              { b.mu.Lock(); defer b.mu.Unlock(); return b.b.String() }

type toData struct {
	dir  string
	port int
	cl   *pgcluster.Cluster
}

func toNewData(t *testing.T) *toData {
	t.Helper()
	tmp, err := os.MkdirTemp("", "takeover_takeover-")
	if err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(tmp, 0o755)
	dir := filepath.Join(tmp, "data")
	port, _ := pgcluster.FreePort()
	d := &toData{dir: dir, port: port, cl: &pgcluster.Cluster{Dir: dir, TCPAddr: "127.0.0.1", Port: port}}
	t.Cleanup(func() {
		_ = d.cl.Stop(context.Background())
		_ = os.RemoveAll(tmp)
	})
	return d
}

func (d *toData) env(extra ...string) []string {
	return append(append(os.Environ(), "DATABASE_URL=", "IDEM_DATA_DIR="+d.dir, fmt.Sprintf("IDEM_DATA_PORT=%d", d.port),
		"CLEANUP_INTERVAL=0"), extra...)
}

func (d *toData) serve(t *testing.T, extra ...string) *toServe {
	t.Helper()
	bin := serverBinary(t)
	httpPort, _ := pgcluster.FreePort()
	addr := fmt.Sprintf("127.0.0.1:%d", httpPort)
	s := &toServe{out: &toBuf{}, exited: make(chan struct{}), addr: addr}
	s.cmd = exec.Command(bin, "serve")
	s.cmd.Env = append(d.env(extra...), "LISTEN_ADDR="+addr)
	s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = s.cmd.Wait(); close(s.exited) }()
	t.Cleanup(func() { _ = s.cmd.Process.Kill(); <-s.exited })
	for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if res, err := http.Get("http://" + addr + "/healthz"); err == nil {
			res.Body.Close()
			if res.StatusCode == 200 {
				return s
			}
		}
		select {
		case <-s.exited:
			t.Fatalf("the server exited:\n%s", s.out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server did not come up:\n%s", s.out.String())
		}
	}
}

func (s *toServe) interrupt(t *testing.T) {
	t.Helper()
	_ = s.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-s.exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("the server did not stop on SIGINT:\n%s", s.out.String())
	}
}

func (s *toServe) kill9() {
	_ = s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.exited
}

func (d *toData) listening() bool {
	port := d.port
	if b, err := os.ReadFile(filepath.Join(d.dir, "data", "postmaster.pid")); err == nil {
		if l := strings.Split(string(b), "\n"); len(l) > 3 {
			if p, err := strconv.Atoi(strings.TrimSpace(l[3])); err == nil {
				port = p
			}
		}
	}
	c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func (d *toData) waitStopped(t *testing.T) bool {
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if !d.listening() {
			return true
		}
	}
	return false
}

// TestTakeoverTwoServesCtrlCOfSecondKeepsFirstsCluster: two serves on one .data (the second on
// another LISTEN_ADDR); Ctrl-C of the second must leave the first's cluster running, and the
// first's Ctrl-C stops it.
func TestTakeoverTwoServesCtrlCOfSecondKeepsFirstsCluster(t *testing.T) {
	t.Parallel()
	d := toNewData(t)
	first := d.serve(t)
	second := d.serve(t)
	second.interrupt(t)
	time.Sleep(300 * time.Millisecond)
	if res, err := http.Get("http://" + first.addr + "/healthz"); err != nil || res.StatusCode != 200 {
		t.Errorf("after the second serve's Ctrl-C, the first's /healthz: %v %v\nsecond's log:\n%s", res, err, second.out.String())
	}
	first.interrupt(t)
	if !d.waitStopped(t) {
		t.Errorf("after the first serve's Ctrl-C the cluster still runs:\n%s", first.out.String())
	}
}

// TestTakeoverKill9PrincipalCreateThenServe: serve killed -9; `principal create` must neither take the
// cluster over nor stop it; the next serve takes it over and its Ctrl-C stops it.
func TestTakeoverKill9PrincipalCreateThenServe(t *testing.T) {
	t.Parallel()
	d := toNewData(t)
	first := d.serve(t)
	first.kill9()
	cmd := exec.Command(serverBinary(t), "principal", "create", "takeover_alice")
	cmd.Env = d.env()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("principal create: %v\n%s", err, out)
	}
	if !d.listening() {
		t.Fatalf("principal create after a kill -9 stopped the orphan cluster:\n%s", out)
	}
	if b, _ := os.ReadFile(filepath.Join(d.dir, "server.pid")); recordedPid(string(b)) != first.cmd.Process.Pid {
		t.Errorf("principal create changed server.pid to %q", b)
	}
	second := d.serve(t)
	second.interrupt(t)
	if !d.waitStopped(t) {
		t.Errorf("the taking-over serve's Ctrl-C left the cluster running:\n%s", second.out.String())
	}
}

// TestTakeoverGarbageServerPid: server.pid holds garbage (or is a directory): the serve takes over.
func TestTakeoverGarbageServerPid(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"garbage", "dir", "empty", "negative"} {
		t.Run(kind, func(t *testing.T) {
			d := toNewData(t)
			first := d.serve(t)
			first.kill9()
			p := filepath.Join(d.dir, "server.pid")
			_ = os.Remove(p)
			switch kind {
			case "garbage":
				_ = os.WriteFile(p, []byte("\x00\xffnot a pid\n"), 0o644)
			case "dir":
				_ = os.Mkdir(p, 0o755)
			case "empty":
				_ = os.WriteFile(p, nil, 0o644)
			case "negative":
				_ = os.WriteFile(p, []byte("-1\n"), 0o644)
			}
			second := d.serve(t)
			second.interrupt(t)
			if !d.waitStopped(t) {
				t.Errorf("server.pid %s: Ctrl-C of the serve left the cluster running:\n%s", kind, second.out.String())
			}
		})
	}
}

// TestTakeoverClusterOnAnotherPort: the cluster of IDEM_DATA_DIR runs on another port than
// IDEM_DATA_PORT (which another PostgreSQL holds): serve connects there, /healthz is 200, the log
// names both ports, principal create goes there.
func TestTakeoverClusterOnAnotherPort(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := toNewData(t)
	// An unrelated cluster on IDEM_DATA_PORT.
	other, stopOther, err := pgcluster.StartTemp(ctx, "takeover_other-", map[string]string{"fsync": "off"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stopOther)
	first := d.serve(t) // runs on d.port
	first.kill9()
	realPort := d.port
	d.port = other.Port
	second := d.serve(t)
	log := second.out.String()
	if !strings.Contains(log, strconv.Itoa(realPort)) || !strings.Contains(log, strconv.Itoa(other.Port)) {
		t.Errorf("the log does not name both ports %d and %d:\n%s", realPort, other.Port, log)
	}
	if res, err := http.Get("http://" + second.addr + "/healthz"); err != nil || res.StatusCode != 200 {
		t.Errorf("/healthz: %v %v", res, err)
	}
	second.interrupt(t)
	d.port = realPort
	if !d.waitStopped(t) {
		t.Errorf("the taking-over serve on another IDEM_DATA_PORT left the cluster running:\n%s", second.out.String())
	}
}

// TestTakeoverBesideALiveReuser: serve A starts the cluster, serve B (another LISTEN_ADDR)
// reuses it; A is killed -9; serve C started and took the cluster over although B still served
// on it, and C's Ctrl-C stopped the cluster under B. A serve takes over only a cluster no other
// client uses.
func TestTakeoverBesideALiveReuser(t *testing.T) {
	t.Parallel()
	d := toNewData(t)
	a := d.serve(t)
	b := d.serve(t)
	a.kill9()
	c := d.serve(t)
	c.interrupt(t)
	time.Sleep(500 * time.Millisecond)
	if res, err := http.Get("http://" + b.addr + "/healthz"); err != nil || res.StatusCode != 200 {
		code := 0
		if res != nil {
			code = res.StatusCode
		}
		t.Errorf("serve B still runs on the cluster, but serve C (started after A's kill -9) took it over and its Ctrl-C stopped it: B's /healthz %d %v\nC's log:\n%s", code, err, c.out.String())
	}
}

// TestTakeoverPastAReusedProcessNumber: the serve that recorded itself in server.pid is killed
// and its process number is then taken by an unrelated live process. A serve recorded the
// number alone until D233, so the next serve took the live process for the server, did not take
// the cluster over, and left it running on exit. The record holds the process's start time now.
func TestTakeoverPastAReusedProcessNumber(t *testing.T) {
	t.Parallel()
	d := toNewData(t)
	first := d.serve(t)
	first.kill9()
	p := filepath.Join(d.dir, "server.pid")
	record, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if f := strings.Fields(string(record)); len(f) != 2 || f[0] != strconv.Itoa(first.cmd.Process.Pid) {
		t.Errorf("server.pid = %q, want the first serve's process number and its start time", record)
	}
	// The reuser: a live process of another start time given the dead server's number.
	reuser := exec.Command("sleep", "60")
	if err := reuser.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = reuser.Process.Kill(); _ = reuser.Wait() })
	f := strings.Fields(string(record))
	f[0] = strconv.Itoa(reuser.Process.Pid)
	if err := os.WriteFile(p, []byte(strings.Join(f, " ")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	second := d.serve(t)
	second.interrupt(t)
	if !d.waitStopped(t) {
		t.Errorf("a live process with the dead server's number kept the serve from taking the cluster over: Ctrl-C left it running:\n%s", second.out.String())
	}
}

// TestClusterServerRecord: the record of this process says it runs; the same number with
// another start time does not; a record of the number alone (an earlier release's) still does.
func TestClusterServerRecord(t *testing.T) {
	dir := t.TempDir()
	m := &Main{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	m.takeCluster(dir)
	if !clusterServerAlive(dir) {
		t.Fatal("the record of this live process reads as a server that is gone")
	}
	b, _ := os.ReadFile(filepath.Join(dir, clusterServerFile))
	f := strings.Fields(string(b))
	if len(f) != 2 {
		t.Fatalf("record %q: want the process number and its start time", b)
	}
	_ = os.WriteFile(filepath.Join(dir, clusterServerFile), []byte(f[0]+" 1\n"), 0o644)
	if clusterServerAlive(dir) {
		t.Error("a live process that started at another time reads as the recorded server")
	}
	_ = os.WriteFile(filepath.Join(dir, clusterServerFile), []byte(f[0]+"\n"), 0o644)
	if !clusterServerAlive(dir) {
		t.Error("a record of the process number alone no longer counts a live process")
	}
	m.cluster = &pgcluster.Cluster{Dir: dir}
	_ = os.WriteFile(filepath.Join(dir, clusterServerFile), b, 0o644)
	m.releaseCluster()
	if _, err := os.Stat(filepath.Join(dir, clusterServerFile)); !os.IsNotExist(err) {
		t.Errorf("releaseCluster left this process's record: %v", err)
	}
}

// TestCtrlCOfTheFirstServeLeavesTheSecondItsDatabase (D264): README: "LISTEN_ADDR=127.0.0.1:8081
// make run serves elsewhere", on the same private cluster. Ctrl-C of the first serve, the one
// that started the cluster, stopped it under the second, whose requests then found no
// database. The first now leaves it running while another client uses it, and the second, the
// last server out, stops it.
func TestCtrlCOfTheFirstServeLeavesTheSecondItsDatabase(t *testing.T) {
	t.Parallel()
	d := toNewData(t)
	first := d.serve(t)
	second := d.serve(t)
	first.interrupt(t)
	time.Sleep(300 * time.Millisecond)
	if res, err := http.Get("http://" + second.addr + "/healthz"); err != nil || res.StatusCode != 200 {
		code := 0
		if err == nil {
			code = res.StatusCode
			res.Body.Close()
		}
		t.Fatalf("after the first serve's Ctrl-C, the second's /healthz: %d %v\nfirst's log:\n%s", code, err, first.out.String())
	}
	second.interrupt(t)
	if !d.waitStopped(t) {
		t.Errorf("after the last serve's Ctrl-C the cluster still runs:\nfirst's log:\n%s\nsecond's log:\n%s", first.out.String(), second.out.String())
	}
}

// TestClusterServerRecordOfAZombie: a server killed (kill -9) whose parent has not reaped it yet
// keeps its process number and start time, but serves nothing: a serve that finds its record
// takes the cluster over, as it does once the process is reaped. Before, the zombie read as a
// live server until its parent waited for it.
func TestClusterServerRecordOfAZombie(t *testing.T) {
	dir := t.TempDir()
	child := exec.Command("sleep", "60")
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	pid := child.Process.Pid
	start, ok := processStart(pid)
	if !ok {
		t.Fatal("no start time for a live child")
	}
	record := []byte(strconv.Itoa(pid) + " " + start + "\n")
	if err := os.WriteFile(filepath.Join(dir, clusterServerFile), record, 0o644); err != nil {
		t.Fatal(err)
	}
	if !clusterServerAlive(dir) {
		t.Fatal("the record of a live child reads as a server that is gone")
	}
	_ = child.Process.Signal(syscall.SIGKILL)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if state, _, _ := processStat(pid); state == "Z" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the killed child did not become a zombie")
		}
	}
	if clusterServerAlive(dir) {
		t.Error("a killed server that its parent has not reaped reads as alive")
	}
	_ = child.Wait()
	if clusterServerAlive(dir) {
		t.Error("a reaped server reads as alive")
	}
}
