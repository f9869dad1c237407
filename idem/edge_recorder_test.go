package idem_test

import (
	"bytes"
	"context"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
)

// TestPrincipalMultipartTempFilesRemoved: a principal function that reads a multipart
// form (a token in a form field, as D178 allows through r.FormValue / ParseMultipartForm)
// gets its file parts spooled to temporary files. net/http removes them after the request
// (finishRequest: w.req.MultipartForm.RemoveAll), but only for its own *http.Request. The first
// build of D184 gave the principal a shallow copy, and its MultipartForm was never removed:
// every such request leaked temporary files. The form is handed back to net/http's request.
func TestPrincipalMultipartTempFilesRemoved(t *testing.T) {
	principal := func(r *http.Request) (string, bool) {
		if err := r.ParseMultipartForm(1); err != nil {
			return "", false
		}
		return r.FormValue("token"), r.FormValue("token") != ""
	}
	srv, _ := auditServer(t, idem.Options{Principal: principal}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})
	dir := t.TempDir()
	t.Setenv("TMPDIR", dir) // after the database is up: the multipart files only
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	mw.WriteField("token", "alice")
	fw, _ := mw.CreateFormFile("upload", "a.bin")
	fw.Write(bytes.Repeat([]byte("x"), 64<<10))
	mw.Close()
	for i, key := range []string{"", "mp-1"} {
		req, _ := http.NewRequest("POST", srv.URL+"/things", bytes.NewReader(buf.Bytes()))
		req.Header.Set("Content-Type", mw.FormDataContentType())
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusCreated {
			t.Fatalf("request %d: %d", i, res.StatusCode)
		}
	}
	var left []os.DirEntry
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		left, _ = os.ReadDir(dir)
		if len(left) == 0 {
			return
		}
	}
	names := []string{}
	for _, e := range left {
		names = append(names, e.Name())
	}
	t.Errorf("after the requests, %d temporary files of the principal's multipart form are left in TMPDIR: %v; net/http removes them for its own request", len(left), names)
}

// againstNetHTTP serves h alone and behind the middleware, sends the same keyed request to both
// and returns (status, body) of each.
func againstNetHTTP(t *testing.T, key string, h http.HandlerFunc) (bs int, bb string, ms int, mb string) {
	t.Helper()
	bare := httptest.NewServer(h)
	t.Cleanup(bare.Close)
	srv, _ := auditServer(t, idem.Options{}, idem.Route{}, h)
	do := func(url string) (int, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "POST", url, bytes.NewReader([]byte(`{}`)))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return -1, err.Error()
		}
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		if err != nil {
			return res.StatusCode, string(b) + " (read error: " + err.Error() + ")"
		}
		return res.StatusCode, string(b)
	}
	bs, bb = do(bare.URL + "/things")
	ms, mb = do(srv.URL + "/things")
	return
}

// TestContentLengthNetHTTPRejectsIsNotALimit: D184 "The recorder refuses a write past
// the declared length as net/http does". net/http takes the handler's Content-Length with
// strconv.ParseInt as it is, no trimming: " 3" is not a length to it (it logs it, drops the
// header, and sends the whole body). The recorder trimmed it, took it for 3, and refused the
// handler's 5 bytes: the client got an empty 201 where net/http sends "abcde".
func TestContentLengthNetHTTPRejectsIsNotALimit(t *testing.T) {
	t.Parallel()
	bs, bb, ms, mb := againstNetHTTP(t, "zz-cl-space", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", "3 ")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "abcde")
	})
	if bs != ms || bb != mb {
		t.Errorf("Content-Length %q, 5 bytes written: net/http alone sends %d %q; behind the middleware %d %q", "3 ", bs, bb, ms, mb)
	}
}

// TestContentLengthSetAfterWriteHeaderIsIgnored: net/http takes the response's headers
// at WriteHeader; a Content-Length set after it changes nothing (the body goes out whole).
// The recorder read its header map at each Write, so a Content-Length set after WriteHeader
// refused the body: an empty 201 where net/http sends "abcde". It keeps the header as at
// WriteHeader now, and sends and stores that.
func TestContentLengthSetAfterWriteHeaderIsIgnored(t *testing.T) {
	t.Parallel()
	bs, bb, ms, mb := againstNetHTTP(t, "zz-cl-late", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		w.Header().Set("Content-Length", "3")
		io.WriteString(w, "abcde")
	})
	if bs != ms || bb != mb {
		t.Errorf("Content-Length 3 set after WriteHeader, 5 bytes written: net/http alone sends %d %q; behind the middleware %d %q", bs, bb, ms, mb)
	}
}

// TestDeclaredLengthWithoutBodyReplaysWhatWasSent: D184 "the answer goes out with its
// true length (the handler's header is dropped when it does not hold), so the first answer and
// its repeats are the same". A handler that declares Content-Length: 5 on a 201 and writes
// nothing: sendTo kept the header when the body was empty (for HEAD's sake, also on a POST),
// so the first client got a 201 whose body never arrived (a read error), while the repeat got
// a whole, empty 201. Only a HEAD keeps it now.
func TestDeclaredLengthWithoutBodyReplaysWhatWasSent(t *testing.T) {
	t.Parallel()
	srv, _ := auditServer(t, idem.Options{}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", "5")
		w.WriteHeader(http.StatusCreated)
	})
	req := "POST /things HTTP/1.1\r\nHost: x\r\nIdempotency-Key: cl-empty\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
	addr := srv.Listener.Addr().String()
	s1, b1, e1 := edgeRaw(t, addr, req)
	s2, b2, e2 := edgeRaw(t, addr, req)
	if s1 != s2 || b1 != b2 || (e1 == nil) != (e2 == nil) {
		t.Errorf("Content-Length 5, nothing written: first %d %q (read error %v); repeat %d %q (read error %v): the repeat is not the first answer",
			s1, b1, e1, s2, b2, e2)
	}
}
