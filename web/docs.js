// The API reference at /docs: renders /openapi.json, the document chatd serves, as HTML.
// Written here, not fetched from a CDN: it works offline and under the page's strict CSP
// (scripts from this server only, nothing inline). It shows what a client needs: each
// operation with its parameters, body and answers, and each schema with its fields.

const METHODS = ["get", "post", "put", "patch", "delete"];

/** An element with attributes and children (strings become text: nothing is parsed as HTML). */
function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  for (const child of children.flat()) if (child !== null && child !== undefined) node.append(child);
  return node;
}

/**
 * A description with its inline Markdown shown: `code` spans and **bold** become elements,
 * the rest stays text. Built from text nodes, so nothing in a description is ever parsed as
 * HTML.
 */
function prose(text) {
  if (!text) return "";
  const nodes = [];
  let at = 0;
  for (const match of text.matchAll(/`([^`]+)`|\*\*(?=\S)(.+?)\*\*/g)) {
    if (match.index > at) nodes.push(text.slice(at, match.index));
    nodes.push(match[1] !== undefined ? el("code", {}, match[1]) : el("strong", {}, match[2]));
    at = match.index + match[0].length;
  }
  if (at < text.length) nodes.push(text.slice(at));
  return nodes;
}

const schemaName = (ref) => ref.split("/").pop();
const anchor = (name) => `schema-${name}`;

/** A schema as a short type: `string`, `integer`, `ChatRequest` (a link), `[Message]`, `A | B`. */
function type(schema) {
  if (!schema) return el("span", { class: "muted" }, "any");
  if (schema.$ref) return el("a", { href: `#${anchor(schemaName(schema.$ref))}` }, schemaName(schema.$ref));
  const variants = schema.oneOf ?? schema.anyOf ?? schema.allOf;
  if (variants) {
    const join = schema.allOf ? " & " : " | ";
    return el("span", {}, variants.flatMap((v, i) => (i ? [join, type(v)] : [type(v)])));
  }
  if (schema.type === "array" || (Array.isArray(schema.type) && schema.type.includes("array"))) {
    return el("span", {}, "[", type(schema.items), "]");
  }
  const name = Array.isArray(schema.type) ? schema.type.join(" | ") : (schema.type ?? "object");
  const detail = schema.enum ? ` (${schema.enum.map((v) => JSON.stringify(v)).join(", ")})` : schema.format ? ` (${schema.format})` : "";
  return el("span", {}, name + detail);
}

/** The fields of an object schema as a table; nothing for other schemas. */
function fields(schema) {
  const properties = Object.entries(schema.properties ?? {});
  if (!properties.length) return null;
  const required = new Set(schema.required ?? []);
  return el("table", {},
    el("tr", {}, el("th", {}, "field"), el("th", {}, "type"), el("th", {}, "meaning")),
    properties.map(([name, field]) => el("tr", {},
      el("td", {}, el("code", {}, name), required.has(name) ? el("span", { class: "required" }, " required") : null),
      el("td", {}, type(field)),
      el("td", {}, prose(field.description)))));
}

function operation(path, method, op) {
  const id = `op-${op.operationId ?? `${method}-${path}`}`;
  const parameters = op.parameters ?? [];
  const body = op.requestBody?.content;
  return el("section", { class: "operation", id },
    el("h3", {}, el("span", { class: `method ${method}` }, method), el("code", {}, path)),
    op.summary ? el("p", {}, prose(op.summary)) : null,
    op.description ? el("p", { class: "muted" }, prose(op.description)) : null,
    parameters.length ? el("table", {},
      el("tr", {}, el("th", {}, "parameter"), el("th", {}, "in"), el("th", {}, "type"), el("th", {}, "meaning")),
      parameters.map((p) => el("tr", {},
        el("td", {}, el("code", {}, p.name), p.required ? el("span", { class: "required" }, " required") : null),
        el("td", {}, p.in), el("td", {}, type(p.schema)), el("td", {}, prose(p.description))))) : null,
    body ? el("p", {}, "Body: ", Object.entries(body).flatMap(([media, c], i) => [i ? ", " : "", type(c.schema), ` (${media})`])) : null,
    el("table", {},
      el("tr", {}, el("th", {}, "answer"), el("th", {}, "meaning"), el("th", {}, "body")),
      Object.entries(op.responses ?? {}).map(([status, r]) => el("tr", {},
        el("td", {}, el("code", {}, status)),
        el("td", {}, prose(r.description)),
        el("td", {}, Object.entries(r.content ?? {}).flatMap(([media, c], i) => [i ? ", " : "", type(c.schema), ` (${media})`]))))));
}

function render(doc) {
  const main = document.getElementById("reference");
  const toc = document.getElementById("toc");
  main.replaceChildren(
    el("h1", {}, `${doc.info.title} API`, el("span", { class: "muted" }, ` ${doc.info.version}`)),
    el("p", { id: "about" }, prose(doc.info.description)),
    el("p", { class: "muted" }, "The whole document: ", el("a", { href: "/openapi.json" }, "/openapi.json"), "."));
  const byTag = new Map();
  for (const [path, item] of Object.entries(doc.paths ?? {})) {
    for (const method of METHODS) {
      const op = item[method];
      if (!op) continue;
      const tag = op.tags?.[0] ?? "other";
      if (!byTag.has(tag)) byTag.set(tag, []);
      byTag.get(tag).push(operation(path, method, op));
    }
  }
  const tags = new Map((doc.tags ?? []).map((t) => [t.name, t.description]));
  for (const [tag, sections] of byTag) {
    const about = tags.get(tag) ? el("p", { class: "muted" }, prose(tags.get(tag))) : "";
    main.append(el("h2", { id: `tag-${tag}` }, tag), about, ...sections);
    toc.append(el("h2", {}, tag), ...sections.map((s) => el("a", { href: `#${s.id}` }, s.querySelector("h3").textContent.replace(/^(\w+)/, "$1 "))));
  }
  const schemas = Object.entries(doc.components?.schemas ?? {});
  main.append(el("h2", { id: "schemas" }, "Schemas"));
  toc.append(el("h2", {}, "schemas"));
  for (const [name, schema] of schemas) {
    main.append(el("section", { class: "schema", id: anchor(name) },
      el("h3", {}, el("code", {}, name)),
      schema.description ? el("p", {}, prose(schema.description)) : null,
      fields(schema) ?? el("p", {}, type({ ...schema, description: undefined }))));
    toc.append(el("a", { href: `#${anchor(name)}` }, name));
  }
  if (location.hash) document.getElementById(location.hash.slice(1))?.scrollIntoView();
}

fetch("/openapi.json")
  .then((response) => (response.ok ? response.json() : Promise.reject(new Error(`HTTP ${response.status}`))))
  .then(render)
  .catch((error) => {
    document.getElementById("reference").replaceChildren(el("p", {}, `The document could not be read: ${error.message}`));
  });
