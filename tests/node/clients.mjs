// The Vercel AI SDK against `openalice-runner serve`: every reply must come back in the requested
// shape. Run by tests/wires/test_clients_structured.py with OPENALICE_BASE_URL and OPENALICE_API_KEY set;
// prints one JSON object: per scenario, the replies that parsed and the failures.
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { generateObject, generateText, stepCountIs, streamText, tool } from 'ai';
import { z } from 'zod';

const provider = createOpenAICompatible({
  name: 'openalice',
  baseURL: process.env.OPENALICE_BASE_URL,
  apiKey: process.env.OPENALICE_API_KEY,
  supportsStructuredOutputs: true,
});
const model = provider(process.env.OPENALICE_MODEL ?? 'default');
const maxOutputTokens = Number(process.env.OPENALICE_MAX_TOKENS ?? 120);

const CITIES = ['Paris', 'Tokyo', 'Berlin', 'Lima', 'Cairo', 'Oslo', 'Rome', 'Madrid', 'Seoul', 'Dublin'];
const weather = tool({
  description: 'Current weather for a city',
  inputSchema: z.object({ city: z.string().describe('City name') }),
  execute: async ({ city }) => ({ city, temperatureC: 21, sky: 'sunny' }),
});
const time = tool({
  description: 'Current time in a timezone',
  inputSchema: z.object({ timezone: z.string() }),
  execute: async ({ timezone }) => ({ timezone, time: '12:00' }),
});
const Person = z.object({ name: z.string(), age: z.number().int() });
const PEOPLE = [['Alice', 31], ['Bob', 45], ['Chen', 28], ['Dara', 52], ['Emil', 19],
  ['Fatima', 38], ['Goran', 61], ['Hana', 24], ['Ivo', 33], ['Jun', 47]];

async function scenario(name, run) {
  const out = { ok: 0, failures: [] };
  for (let i = 0; i < 10; i++) {
    try {
      const problem = await run(i);
      if (problem) out.failures.push(`${i}: ${problem}`);
      else out.ok++;
    } catch (err) {
      out.failures.push(`${i}: ${err?.name}: ${String(err?.message).slice(0, 300)}`);
    }
  }
  return [name, out];
}

const checkCall = (call) => {
  if (!call) return 'no tool call';
  if (!['weather', 'time'].includes(call.toolName)) return `unknown tool ${call.toolName}`;
  return null;
};

// issue 33: one tool, toolChoice 'required', a small maxOutputTokens; a model looping inside the
// string value used to run into the budget with the call unclosed (AI_ToolChoiceViolationError)
const stockPrice = tool({
  description: 'The latest stock price of a company',
  inputSchema: z.object({ symbol: z.string() }),
  execute: async ({ symbol }) => ({ symbol, price: 101.5 }),
});
const STOCK_PROMPTS = ['Check MSFT for me', 'What is Apple trading at?', 'Price of NVDA?', 'How is Tesla stock doing today?',
  'Look up the share price of Microsoft', 'Get me the stock price for AMZN', 'Is GOOG up today?',
  'What does IBM stock cost?', 'Quote for Netflix shares', 'Stock price of the Coca-Cola Company please'];
const budgetScenario = (budget) => scenario(`stock_required_${budget}`, async (i) => {
  const r = await generateText({
    model, maxOutputTokens: budget, tools: { get_stock_price: stockPrice }, toolChoice: 'required',
    stopWhen: stepCountIs(1), prompt: STOCK_PROMPTS[i],
  });
  const call = r.toolCalls[0];
  if (!call || call.toolName !== 'get_stock_price') return `no get_stock_price call: ${JSON.stringify(r.content).slice(0, 200)}`;
  return typeof call.input?.symbol === 'string' ? null : `bad input ${JSON.stringify(call.input)}`;
});

if (process.env.OPENALICE_SCENARIOS === 'budgets') {
  const budgets = (process.env.OPENALICE_BUDGETS ?? '24,48').split(',').map(Number);
  const out = [];
  for (const budget of budgets) out.push(await budgetScenario(budget));
  console.log(JSON.stringify(Object.fromEntries(out)));
  process.exit(0);
}

const results = Object.fromEntries([
  await scenario('generateText_required', async (i) => {
    const r = await generateText({
      model, maxOutputTokens, tools: { weather, time }, toolChoice: 'required',
      prompt: `What is the weather in ${CITIES[i]}?`,
    });
    return checkCall(r.toolCalls[0]) ?? (typeof r.toolCalls[0].input === 'object' ? null : 'input not an object');
  }),
  await scenario('generateText_auto', async (i) => {
    const r = await generateText({
      model, maxOutputTokens, tools: { weather, time }, toolChoice: 'auto',
      prompt: `Tell me about the weather in ${CITIES[i]}.`,
    });
    // either a valid call or text: the SDK threw on anything else
    return r.toolCalls.length ? checkCall(r.toolCalls[0]) : (typeof r.text === 'string' ? null : 'no text');
  }),
  await scenario('streamText_tool', async (i) => {
    const r = streamText({
      model, maxOutputTokens, tools: { weather }, toolChoice: 'required', stopWhen: stepCountIs(1),
      prompt: `Weather in ${CITIES[i]} please.`,
    });
    let errored = null;
    for await (const part of r.fullStream) if (part.type === 'error') errored = String(part.error);
    if (errored) return errored;
    const calls = await r.toolCalls;
    return checkCall(calls[0]) ?? (calls[0].input && typeof calls[0].input.city === 'string' ? null : 'no city');
  }),
  await scenario('generateObject_zod', async (i) => {
    const [who, age] = PEOPLE[i];
    const r = await generateObject({
      model, maxOutputTokens, schema: Person, schemaName: 'person',
      prompt: `Extract the person as JSON: ${who} is ${age} years old.`,
    });
    return Person.safeParse(r.object).success ? null : 'object does not match the schema';
  }),
]);
console.log(JSON.stringify(results));
