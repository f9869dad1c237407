package main

import (
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// TestQuickstartHintQuotesTheDirectory: the hint serve logs on a private cluster names a
// directory other than the default, and the command it shows, pasted into a shell, gives the
// principal command that very directory, whatever it holds (a space, a quote, a dollar sign).
// The directory was pasted in as it was: `IDEM_DATA_DIR=/tmp/my data go run ...` runs a
// command named "data".
func TestQuickstartHintQuotesTheDirectory(t *testing.T) {
	for _, dir := range []string{"/tmp/plain-dir_1.x", "/tmp/my data", "/tmp/it's", `/tmp/$HOME and "q" \ *`, "rel/dir"} {
		hint := quickstartHint(dir, "127.0.0.1:8080", "postgres://x")
		m := regexp.MustCompile("`TOKEN=\\$\\((.*) go run ./cmd/server principal create alice \\| awk").FindStringSubmatch(hint)
		if m == nil {
			t.Fatalf("%q: no command in the hint %q", dir, hint)
		}
		out, err := exec.Command("sh", "-c", m[1]+` sh -c 'printf %s "$IDEM_DATA_DIR"'`).Output()
		if err != nil || string(out) != dir {
			t.Errorf("the hint's command %q gives IDEM_DATA_DIR %q (%v), want %q", m[1], out, err, dir)
		}
	}
	if hint := quickstartHint(defaultConfig().DataDir, "127.0.0.1:8080", "postgres://x"); strings.Contains(hint, "IDEM_DATA_DIR") {
		t.Errorf("the default directory is named: %q", hint)
	}
}
