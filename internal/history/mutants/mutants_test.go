package mutants

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestMutantsApply: every mutant's text occurs exactly once in its file, so that a change of
// the code does not silently turn a mutant into the unmutated tree.
func TestMutantsApply(t *testing.T) {
	names := map[string]bool{}
	for _, m := range All {
		if names[m.Name] {
			t.Errorf("%s: two mutants with this name", m.Name)
		}
		names[m.Name] = true
		b, err := os.ReadFile(filepath.Join("..", "..", "..", m.File))
		if err != nil {
			t.Errorf("%s: %v", m.Name, err)
			continue
		}
		if n := strings.Count(string(b), m.Search); n != 1 {
			t.Errorf("%s: its text occurs %d times in %s, want once", m.Name, n, m.File)
		}
		if m.Search == m.Replace {
			t.Errorf("%s: changes nothing", m.Name)
		}
	}
	if len(All) < 10 {
		t.Errorf("%d mutants, want at least ten", len(All))
	}
}
