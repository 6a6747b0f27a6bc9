// The page's Markdown renderer (web/markdown.js) on its own: what it builds, and that
// nothing in the source becomes markup it did not build.

import { test } from "node:test";
import assert from "node:assert/strict";
import { renderMarkdown } from "../../../web/markdown.js";

test("blocks: headings, paragraphs, lists, fenced code", () => {
  assert.equal(renderMarkdown("# Title\n\nOne\ntwo"), "<h1>Title</h1>\n<p>One<br>two</p>");
  assert.equal(renderMarkdown("- a\n- b\n\n1. c\n2) d"), "<ul><li>a</li><li>b</li></ul>\n<ol><li>c</li><li>d</li></ol>");
  assert.equal(
    renderMarkdown("```rust\nlet x = **1**;\n```\nafter"),
    '<pre><code class="language-rust">let x = **1**;</code></pre>\n<p>after</p>',
  );
  // A fence still open (mid-stream) holds the rest as code.
  assert.equal(renderMarkdown("```\npartial"), "<pre><code>partial</code></pre>");
});

test("inline: bold, italic, code spans, http(s) links only", () => {
  assert.equal(renderMarkdown("**b** *i* _j_ `a*b*`"), "<p><strong>b</strong> <em>i</em> <em>j</em> <code>a*b*</code></p>");
  assert.equal(
    renderMarkdown("[doc](https://example.com/a_b_c?x=1&y=2)"),
    '<p><a href="https://example.com/a_b_c?x=1&amp;y=2" target="_blank" rel="noopener noreferrer">doc</a></p>',
  );
  for (const url of ["javascript:alert(1)", "data:text/html,hi", "/relative", "ftp://host/file"]) {
    assert.ok(!renderMarkdown(`[x](${url})`).includes("<a"), url);
  }
  assert.equal(renderMarkdown("snake_case_name"), "<p>snake_case_name</p>");
});

test("HTML in the source is text", () => {
  const html = renderMarkdown('<img src=x onerror="alert(1)"> <script>alert(2)</script> [a](https://x.y/"onmouseover="z)');
  assert.ok(!/<(img|script)/.test(html), html);
  assert.ok(html.includes("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;"), html);
  assert.ok(!html.includes('"onmouseover'), "a quote cannot leave the href attribute");
  // The renderer's own placeholders cannot be forged from the source.
  assert.equal(renderMarkdown("\uE0000\uE001 `c`"), "<p>0 <code>c</code></p>");
});
