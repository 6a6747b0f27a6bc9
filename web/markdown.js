// A small, safe Markdown renderer for answers. The whole text is HTML-escaped first, so the
// only markup in the result is what these rules build: headings, paragraphs, bold, italic,
// code spans, fenced code blocks, lists and links (http and https only; anything else stays
// text). Unclosed blocks render as far as they go, which suits a streaming answer.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FENCE = /^\s*```\s*([\w+-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+/;
const NUMBERED = /^\s*\d{1,9}[.)]\s+/;

/** Markdown source → HTML that holds no markup of the source's own. */
export function renderMarkdown(source) {
  // Placeholders below use private-use characters; none may come from the source.
  const lines = escapeHtml(source.replace(/[\uE000\uE001]/g, "")).split("\n");
  const html = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const code = [];
      for (i += 1; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i += 1) code.push(lines[i]);
      i += 1;
      const language = fence[1] ? ` class="language-${fence[1]}"` : "";
      html.push(`<pre><code${language}>${code.join("\n")}</code></pre>`);
    } else if (HEADING.test(line)) {
      const [, hashes, text] = line.match(HEADING);
      html.push(`<h${hashes.length}>${inline(text)}</h${hashes.length}>`);
      i += 1;
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const marker = BULLET.test(line) ? BULLET : NUMBERED;
      const items = [];
      for (; i < lines.length && marker.test(lines[i]); i += 1) {
        items.push(`<li>${inline(lines[i].replace(marker, ""))}</li>`);
      }
      const tag = marker === BULLET ? "ul" : "ol";
      html.push(`<${tag}>${items.join("")}</${tag}>`);
    } else if (line.trim() === "") {
      i += 1;
    } else {
      const paragraph = [];
      for (; i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i]); i += 1) {
        paragraph.push(inline(lines[i]));
      }
      html.push(`<p>${paragraph.join("<br>")}</p>`);
    }
  }
  return html.join("\n");
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || BULLET.test(line) || NUMBERED.test(line);
}

/**
 * Inline rules on one escaped line. Code spans and links are set aside first (as numbered
 * placeholders), so emphasis never reaches inside code or a URL.
 */
function inline(text) {
  const kept = [];
  const keep = (html) => `\uE000${kept.push(html) - 1}\uE001`;
  let out = text.replace(/`([^`]+)`/g, (_, code) => keep(`<code>${code}</code>`));
  out = out.replace(/\[([^\]]+)\]\(([^()\s]+)\)/g, (whole, label, url) =>
    /^https?:\/\//i.test(url)
      ? keep(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`)
      : whole,
  );
  out = emphasis(out);
  return out.replace(/\uE000(\d+)\uE001/g, (_, n) => kept[Number(n)]);
}

function emphasis(text) {
  return text
    .replace(/\*\*(?=\S)(.+?)\*\*|__(?=\S)(.+?)__/g, (_, a, b) => `<strong>${a ?? b}</strong>`)
    .replace(/\*(?=[^\s*])([^*]*?)\*/g, "<em>$1</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?)_(?!\w)/g, "$1<em>$2</em>");
}
