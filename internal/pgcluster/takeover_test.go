package pgcluster

import (
	"context"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// TestTwoStartsOfAStoppedClusterTakeTurns: a server and a command started together on a
// stopped private cluster both started it; the loser failed on the winner's postmaster.pid
// ("lock file already exists"), and the winner's server was then stopped again with it. Init
// and Start now take turns on a lock in Dir: exactly one starts the cluster, the other finds it
// running (Started false), and both succeed. D257; on the previous code one of them failed.
func TestTwoStartsOfAStoppedClusterTakeTurns(t *testing.T) {
	t.Parallel()
	first := initTemp(t, &Cluster{TCPAddr: "127.0.0.1", AnyPort: true})
	ctx := context.Background()
	for round := range 3 {
		cs := []*Cluster{
			{Dir: first.Dir, SocketDir: first.SocketDir, TCPAddr: "127.0.0.1", Port: first.Port, AnyPort: true},
			{Dir: first.Dir, SocketDir: first.SocketDir, TCPAddr: "127.0.0.1", Port: first.Port, AnyPort: true},
		}
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for i, c := range cs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if errs[i] = c.Init(ctx); errs[i] == nil {
					errs[i] = c.Start(ctx)
				}
			}()
		}
		wg.Wait()
		if errs[0] != nil || errs[1] != nil {
			t.Fatalf("round %d: two starts of a stopped cluster at once: %v; %v", round, errs[0], errs[1])
		}
		if cs[0].Started() == cs[1].Started() {
			t.Fatalf("round %d: started %v and %v; want exactly one start, the other reusing it", round, cs[0].Started(), cs[1].Started())
		}
		first.Port = cs[0].Port
		if err := cs[0].Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRootLeavesAnotherUsersDirectory: as root, the private cluster runs as postgres, and its
// directory was handed to postgres before anything was checked, whoever it belonged to: a
// `sudo make run` on a user's own .data (or a directory of other files) locked that user out of
// it. Such a directory is now refused, named, and left as it was; a directory the cluster made
// (postgres's) or root's own empty one is still used. D257.
func TestRootLeavesAnotherUsersDirectory(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("only root hands the directory to postgres; this process is not root")
	}
	nobody, err := user.Lookup("nobody")
	if err != nil {
		t.Fatalf("the user nobody: %v", err)
	}
	uid, _ := strconv.Atoi(nobody.Uid)
	parent := searchableTemp(t)
	owned := filepath.Join(parent, "owned")
	if err := os.Mkdir(owned, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(owned, uid, -1); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(parent, "other")
	if err := os.Mkdir(other, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(other, "notes.txt"), []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{owned, other} {
		var before syscall.Stat_t
		if err := syscall.Stat(d, &before); err != nil {
			t.Fatal(err)
		}
		err := (&Cluster{Dir: d}).prepare()
		var after syscall.Stat_t
		if serr := syscall.Stat(d, &after); serr != nil {
			t.Fatal(serr)
		}
		if err == nil || !strings.Contains(err.Error(), "would take the directory over") || after.Uid != before.Uid {
			t.Errorf("%s (owner %d): %v; owner now %d; want it refused and left as it was", d, before.Uid, err, after.Uid)
		}
	}
	empty := filepath.Join(parent, "empty")
	if err := os.Mkdir(empty, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := (&Cluster{Dir: empty}).prepare(); err != nil {
		t.Errorf("root's own empty directory: %v; want it used", err)
	}
}

// searchableTemp is a temporary directory that the postgres user may search (a cluster's
// directory may sit in it when the test is root), removed when the test ends.
func searchableTemp(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "idem-pgcluster-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}
