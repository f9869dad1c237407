package idemhttp

import (
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestProblemTableMatchesDocs: the one problem table (code, status, title) and the table in
// docs/http.md agree, and every code has its own section there (the anchor its type URI
// points at).
func TestProblemTableMatchesDocs(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../docs/http.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	i, j := strings.Index(doc, "<!-- problems:begin -->"), strings.Index(doc, "<!-- problems:end -->")
	if i < 0 || j < i {
		t.Fatal("docs/http.md has no problems table")
	}
	row := regexp.MustCompile("(?m)^\\| `([a-z_]+)` \\| ([0-9]{3}) \\| (.+) \\|$")
	documented := map[string]problemSpec{}
	for _, m := range row.FindAllStringSubmatch(doc[i:j], -1) {
		status, _ := strconv.Atoi(m[2])
		documented[m[1]] = problemSpec{status, m[3]}
	}
	for code, spec := range problems {
		if documented[code] != spec {
			t.Errorf("%s: the code says %d %q, docs/http.md says %d %q", code, spec.status, spec.title, documented[code].status, documented[code].title)
		}
		if !strings.Contains(doc, "\n### "+code+"\n") {
			t.Errorf("docs/http.md has no section ### %s (the anchor of its type URI)", code)
		}
	}
	for code := range documented {
		if _, ok := problems[code]; !ok {
			t.Errorf("docs/http.md lists %s, which the middleware does not answer", code)
		}
	}
}
