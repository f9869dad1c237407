package tests

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// maxTrackedBytes is the largest file the repository tracks without a place in bigTracked:
// the largest source today (sql/idem.sql) is about 140 kB.
const maxTrackedBytes = 2 << 20

// bigTracked are the files allowed over maxTrackedBytes, by their path from the repository's
// root. None today.
var bigTracked = map[string]bool{}

// executableMagic are the first bytes of the executables a `go build` leaves behind: ELF,
// Mach-O (32 and 64 bits, both byte orders, and universal), and PE (MZ).
var executableMagic = [][]byte{
	[]byte("\x7fELF"),
	[]byte("\xfe\xed\xfa\xce"), []byte("\xce\xfa\xed\xfe"),
	[]byte("\xfe\xed\xfa\xcf"), []byte("\xcf\xfa\xed\xfe"),
	[]byte("\xca\xfe\xba\xbe"),
	[]byte("MZ"),
}

// TestNoBuildOutputTracked: no file git tracks is an executable (a binary that `go build`
// left in the checkout, such as sqlbundle at the root, once committed by mistake), and none is
// larger than maxTrackedBytes unless bigTracked lists it.
func TestNoBuildOutputTracked(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("no git on PATH")
	}
	root := filepath.Join("..")
	cmd := exec.Command("git", "ls-files", "-z")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Skipf("git ls-files in %s: %v (not a git checkout?)", root, err)
	}
	for _, path := range strings.Split(strings.TrimSuffix(string(out), "\x00"), "\x00") {
		if path == "" {
			continue
		}
		f, err := os.Open(filepath.Join(root, path))
		if os.IsNotExist(err) {
			continue // deleted in the work tree, not yet in the index
		}
		if err != nil {
			t.Fatal(err)
		}
		info, err := f.Stat()
		if err != nil || !info.Mode().IsRegular() {
			f.Close()
			continue
		}
		head := make([]byte, 4)
		n, _ := io.ReadFull(f, head)
		f.Close()
		for _, magic := range executableMagic {
			if bytes.HasPrefix(head[:n], magic) {
				t.Errorf("%s is tracked and is an executable (a build output? git rm it and ignore it in .gitignore)", path)
				break
			}
		}
		if info.Size() > maxTrackedBytes && !bigTracked[path] {
			t.Errorf("%s is tracked and has %d bytes, more than %d (a build output? else list it in bigTracked)",
				path, info.Size(), maxTrackedBytes)
		}
	}
}
