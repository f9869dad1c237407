package canon

import (
	"unicode/utf16"
	"unicode/utf8"
)

func hexDigit(c byte) (rune, bool) {
	switch {
	case c >= '0' && c <= '9':
		return rune(c - '0'), true
	case c >= 'a' && c <= 'f':
		return rune(c-'a') + 10, true
	case c >= 'A' && c <= 'F':
		return rune(c-'A') + 10, true
	}
	return 0, false
}

func (p *parser) hex4() (rune, error) {
	if p.pos+4 > len(p.data) {
		return 0, p.fail("short \\u escape")
	}
	var r rune
	for _, c := range p.data[p.pos : p.pos+4] {
		d, ok := hexDigit(c)
		if !ok {
			return 0, p.fail("invalid \\u escape")
		}
		r = r<<4 | d
	}
	p.pos += 4
	return r, nil
}

// string decodes the JSON string at p.pos (which is '"'). A string without escapes is
// returned as a slice of the input.
func (p *parser) string() (span, error) {
	p.pos++
	start := p.pos
	// Fast path: no escapes, so nothing to copy.
	for p.pos < len(p.data) {
		c := p.data[p.pos]
		if c == '"' {
			p.pos++
			return span{int32(start), int32(p.pos - 1 - start)}, nil
		}
		if c == '\\' || c < 0x20 {
			break
		}
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRune(p.data[p.pos:])
			if r == utf8.RuneError && size <= 1 {
				return span{}, p.fail("invalid UTF-8")
			}
			p.pos += size
			continue
		}
		p.pos++
	}
	escaped := false
	arenaStart := len(p.arena)
	p.arena = append(p.arena, p.data[start:p.pos]...)
	for p.pos < len(p.data) {
		c := p.data[p.pos]
		switch {
		case c == '"':
			p.pos++
			if !escaped {
				p.arena = p.arena[:arenaStart]
				return span{int32(start), int32(p.pos - 1 - start)}, nil
			}
			return span{int32(-arenaStart - 1), int32(len(p.arena) - arenaStart)}, nil
		case c < 0x20:
			return span{}, p.fail("control character in a string")
		case c >= utf8.RuneSelf:
			r, size := utf8.DecodeRune(p.data[p.pos:])
			if r == utf8.RuneError && size <= 1 {
				return span{}, p.fail("invalid UTF-8")
			}
			p.arena = append(p.arena, p.data[p.pos:p.pos+size]...)
			p.pos += size
		case c != '\\':
			p.arena = append(p.arena, c)
			p.pos++
		default:
			escaped = true
			p.pos++
			if p.pos >= len(p.data) {
				return span{}, p.fail("unexpected end in an escape")
			}
			e := p.data[p.pos]
			p.pos++
			switch e {
			case '"', '\\', '/':
				p.arena = append(p.arena, e)
			case 'b':
				p.arena = append(p.arena, '\b')
			case 'f':
				p.arena = append(p.arena, '\f')
			case 'n':
				p.arena = append(p.arena, '\n')
			case 'r':
				p.arena = append(p.arena, '\r')
			case 't':
				p.arena = append(p.arena, '\t')
			case 'u':
				r, err := p.hex4()
				if err != nil {
					return span{}, err
				}
				if utf16.IsSurrogate(r) {
					if r >= 0xDC00 || p.pos+2 > len(p.data) || p.data[p.pos] != '\\' || p.data[p.pos+1] != 'u' {
						return span{}, p.fail("lone surrogate")
					}
					p.pos += 2
					lo, err := p.hex4()
					if err != nil {
						return span{}, err
					}
					if lo < 0xDC00 || lo > 0xDFFF {
						return span{}, p.fail("lone surrogate")
					}
					r = utf16.DecodeRune(r, lo)
				}
				if r == 0 {
					p.nul = true
				}
				p.arena = utf8.AppendRune(p.arena, r)
			default:
				return span{}, p.fail("invalid escape")
			}
		}
	}
	return span{}, p.fail("unterminated string")
}
